"""Start-up hook of every Python process an agent starts for a job (the agent puts this directory
first on the workers' PYTHONPATH): starts the flight-recorder hook (../frhook.py) and the step hook
(../stephook.py), each loaded by path so that neither stalwart nor torch is imported here, then runs
the `sitecustomize` this one shadows, if there is one further along the path."""
import importlib.machinery
import importlib.util
import os
import sys


def _exec(spec):
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _main():
    here = os.path.dirname(os.path.abspath(__file__))
    for name, what in (("frhook", "flight-recorder"), ("stephook", "step")):
        try:
            path = os.path.join(os.path.dirname(here), f"{name}.py")
            hook = _exec(importlib.util.spec_from_file_location(f"_stalwart_{name}", path))
            sys.modules[f"_stalwart_{name}"] = hook
            hook.start()
        except Exception as e:  # a hook that cannot start must not stop the training script
            sys.stderr.write(f"stalwart: the {what} hook did not start: {e}\n")
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        _exec(spec)


_main()
