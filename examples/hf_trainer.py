"""A Hugging Face `transformers.Trainer` script under stalwart: one callback, one argument to `train`.

    stalwart run --machines 2 --gpus-per-machine 1 --standby 1 -- python examples/hf_trainer.py

The model is a tiny GPT-2 built from a config with random weights (nothing is downloaded:
HF_HUB_OFFLINE=1 is set below); the token data are generated from a seed. The Trainer runs DDP on
CPU with gloo over the ranks stalwart (or torchrun) starts. `hf.install` adds stalwart's
`TrainerCallback`: each step's loss and per-rank gradient norms reported, the model's, optimizer's
and scheduler's state and the `TrainerState` in the in-memory tier every step, and `resume_dir()`
hands a restarted run that state as a Trainer checkpoint directory.
"""
import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from stalwart.worker.adapters import hf  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """Sequences of a repeating pattern with noise: learnable, generated from the index."""

    def __init__(self, n: int, seq: int, vocab: int):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(1_000_003 + i)
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        ids = (start + torch.arange(self.seq)) % self.vocab
        return {"input_ids": ids, "labels": ids.clone()}


class Printer(hf._tf.TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step - 1} loss {logs['loss']!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("STALWART_CKPT_DIR", "hf-out"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=a.batch,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, ddp_backend="gloo" if world > 1 else None, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, ddp_find_unused_parameters=False,
                             ddp_broadcast_buffers=False)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(a.steps * a.batch * world, 16, 64),
                      callbacks=[Printer()])
    torch.set_num_threads(1)      # (again: Accelerate sets its own count, one per core, per process)
    cb = hf.install(trainer)
    trainer.train(resume_from_checkpoint=cb.resume_dir())
    if trainer.is_world_process_zero():
        print(f"final step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
