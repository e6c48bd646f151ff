"""``glm5(*args)``: the ``glm5`` command run in a subprocess (as ``python -m glm5_core.cli``), for the tests of its
subcommands. Not collected itself (not test_*.py)."""
import os
import subprocess
import sys


def glm5(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    full_env.pop("GLM5_STRICT", None) if "GLM5_STRICT" not in (env or {}) else None
    return subprocess.run([sys.executable, "-m", "glm5_core.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=900)


def glm5_here(capsys, *args):
    """``(exit code, stderr)`` of ``glm5 ARGS`` run in this process (cheaper than a subprocess; the CLI's own
    error handling, exit codes included, is what runs)."""
    from glm5_core import cli

    try:
        code = cli.main(list(args))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err
