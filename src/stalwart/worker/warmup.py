"""What a warm standby does while it waits for its ranks, and when it gets them.

Both ways a spare waits use these: inside `worker.init()` (the context) and at the adapters'
import (`standby.wait_if_standby`), for a script that builds its own process groups.
"""
from __future__ import annotations

from stalwart.protocol import WARM_TITLE_MARK


def warm_up_torch() -> None:
    """Pay torch's first-use costs while waiting as a spare, not after activation.

    Building the first optimizer imports torch._dynamo (about 1 s on these machines, as long as
    importing torch itself); the first backward starts the autograd engine's threads. A training
    script does both right after `init()` returns, so a warm worker that skipped this would spend
    that second on the restart's critical path.
    """
    import torch      # (a standby's script has loaded it already; importing this module does not)
    p = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([p], lr=1e-3)
    (p * p).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def untitle_warm() -> None:
    """A warm worker forked by its machine's fork server shows that it waits in its command line
    (agent/forkclient.py's WARM_MARK): it trains now."""
    try:
        import setproctitle
    except ImportError:
        return
    title = setproctitle.getproctitle()
    if title.endswith(WARM_TITLE_MARK):
        setproctitle.setproctitle(title[:-len(WARM_TITLE_MARK)])
