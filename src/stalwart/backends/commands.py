"""The backends' subcommands (`stalwart slurm …`, `stalwart k8s …`): cli.py adds them here."""
from __future__ import annotations


def add_commands(sub) -> None:
    from stalwart.backends import k8s_manifests, slurm_submit
    from stalwart.cli.common import job_options
    slurm_submit.add_parser(sub, job_options)
    k8s_manifests.add_parser(sub)
