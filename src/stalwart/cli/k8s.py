"""The `stalwart k8s` commands: `manifests` renders the Kubernetes objects of a job
(`backends/k8s_manifests.py` says which) to stdout, a file or a kustomize base."""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from stalwart.backends.k8s_manifests import load_job, render, token_from, write_kustomize
from stalwart.errors import UserError


def cmd_k8s_manifests(a) -> int:
    if a.spare < 0:
        raise UserError(f"--spare must be >= 0 (got {a.spare})")
    config = a.config or a.job
    if config is None:
        raise UserError("k8s manifests needs --config JOB.yaml (a job spec plus a kubernetes: mapping)")
    if a.job is not None:
        print("warning: --job is deprecated for `k8s manifests`: use --config", file=sys.stderr)
    if a.output and a.kustomize:
        raise UserError("-o and --kustomize go to different places: give one")
    spec, cfg = load_job(config)
    token_file = a.token_file or os.path.join(os.path.dirname(os.path.abspath(config)), f"stalwart-{cfg.tag}.token")
    # the controller's secret is kept beside the token, so that two renders give the same Secret
    objs = render(spec, cfg, token_from(token_file), a.spare, secret=token_from(token_file + ".secret"))
    if not cfg.checkpoint_dir:
        print("warning: no kubernetes.checkpoint: durable checkpoints stay in each agent pod and leave with it "
              "(give a ReadWriteMany PVC as checkpoint.claim, or checkpoint.url)", file=sys.stderr)
    if a.kustomize:
        write_kustomize(a.kustomize, objs)
        print(f"wrote a kustomize base in {a.kustomize}: kubectl apply -k {a.kustomize} "
              f"(namespace {cfg.namespace} must exist)", file=sys.stderr)
        return 0
    text = yaml.safe_dump_all(objs, sort_keys=False)
    if a.output:
        fd = os.open(a.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)     # it holds the API token
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(a.output, 0o600)
        print(f"wrote {a.output}: kubectl apply -f {a.output} (namespace {cfg.namespace} must exist)",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_parsers(sub) -> None:
    s = sub.add_parser("k8s", help="run jobs on Kubernetes").add_subparsers(dest="k8s_cmd", required=True)
    p = s.add_parser("manifests", help="the Kubernetes objects of a job (controller, RBAC, agent pods)")
    p.add_argument("--config", help="job YAML: a job spec plus a kubernetes: mapping")
    p.add_argument("--job", help=argparse.SUPPRESS)        # (the old name of --config)
    p.add_argument("--spare", type=int, default=0, help="more agent pods beyond the active and standby ones")
    p.add_argument("--token-file", help="where the API token is kept across renders (default: "
                                        "stalwart-<tag>.token next to the job YAML; made on the first render)")
    p.add_argument("-o", "--output", help="write here (mode 0600: it holds the API token) instead of stdout")
    p.add_argument("--kustomize", metavar="DIR", help="write a kustomize base here instead (kubectl apply -k DIR)")
    p.set_defaults(fn=cmd_k8s_manifests)
