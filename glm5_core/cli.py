"""The ``glm5`` command.

Each subcommand lives in its own module that defines ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so ``glm5 backends`` stays fast and import-light.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional

SUBCOMMANDS = {
    "backends": ("glm5_core.cli_backends", "list backends, whether each is available, and what every op resolves to"),
    "conformance": ("glm5_core.conformance.cli",
                    "check a backend against the reference and write JSON + Markdown reports"),
    "pretrain": ("glm5_core.train.cli", "pretrain a GLM-5-style model from a YAML config"),
    "export-onnx": ("glm5_core.model.onnx_export", "export the prefill forward of a checkpoint to ONNX"),
    "rl": ("glm5_core.rl.cli", "asynchronous RL from a pretraining checkpoint"),
    "serve": ("glm5_core.rl.serve_cli", "serve a checkpoint over SGLang's HTTP API (an engine for glm5 rl)"),
    "proxy": ("glm5_core.rl.proxy_cli",
              "serve the OpenAI API (chat completions, tools) in front of an SGLang-API engine"),
    "make-tokenizer": ("glm5_core.rl.make_tokenizer_cli",
                       "write a small chat tokenizer directory for trying agents and glm5 proxy"),
}


def add_config_arguments(parser: argparse.ArgumentParser, example: str, set_example: str) -> None:
    """``--config``, ``--set KEY=VALUE`` (repeatable) and ``--check-config``, as pretrain and rl take them."""
    parser.add_argument("--config", required=True, help=f"YAML run config (see {example})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config value, e.g. --set {set_example} (VALUE is read as YAML; "
                             f"list entries as name[i]; repeatable; checked like the file)")
    parser.add_argument("--check-config", action="store_true",
                        help="check the config (and that the run fits this machine's memory), print it resolved, "
                             "and exit without building anything")


def add_backend_argument(parser: argparse.ArgumentParser, default: Optional[str] = "auto",
                         help: str = "kernel backend (default: %(default)s = detect the hardware)") -> None:
    """``--backend`` as every command takes it: ``auto`` or any discovered backend, third-party ones included."""
    from glm5_core import registry

    choices = ("auto", *registry.backends())
    parser.add_argument("--backend", default=default, metavar="{" + ",".join(choices) + "}", help=help)


def extras_providing(module: str, distribution: str = "glm5-core") -> list[str]:
    """The extras of ``distribution`` whose requirements install the top-level ``module`` (a requirement's
    project name, normalised, equal to the module name: ``tokenizers``, ``onnx``, ``openai``, ...)."""
    import importlib.metadata
    import re

    try:
        requires = importlib.metadata.metadata(distribution).get_all("Requires-Dist") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    wanted = module.split(".")[0].lower().replace("-", "_")
    found = []
    for requirement in requires:
        project = re.match(r"[A-Za-z0-9_.\-]+", requirement)
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", requirement)
        if project and extra and project.group(0).lower().replace("-", "_") == wanted:
            found.append(extra.group(1))
    return sorted(set(found), key=lambda e: (e in ("dev", "bench"), e))  # the user-facing extra first


def missing_package_message(module: str) -> str:
    """One line for a command whose optional package ``module`` is not installed."""
    extras = extras_providing(module)
    if extras:
        return (f"the {module.split('.')[0]} package is not installed; install the extra: "
                f"pip install 'glm5-core[{extras[0]}]'")
    return f"the {module.split('.')[0]} package is not installed (GLM5_DEBUG=1 shows where it was needed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5",
                                     description="glm5-core: portable kernels and drivers for GLM-5-class models")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"glm5: error: unknown command {argv[0]!r}; expected one of {', '.join(SUBCOMMANDS)}",
                  file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    sub_parser = argparse.ArgumentParser(prog=f"glm5 {name}", description=help_text)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(rest)
    from glm5_core.registry import BackendCoverageError, BackendUnavailableError

    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:  # `glm5 backends | head`
        sys.stdout = open(os.devnull, "w")
        return 0
    except (BackendUnavailableError, BackendCoverageError, ValueError, TypeError, FileNotFoundError) as exc:
        if os.environ.get("GLM5_DEBUG"):
            raise
        print(f"glm5 {name}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional package this command needs: name the extra that installs it
        if os.environ.get("GLM5_DEBUG") or not exc.name:
            raise
        print(f"glm5 {name}: error: {missing_package_message(exc.name)}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # the config check's estimate is a lower bound: an allocation can still fail
        if os.environ.get("GLM5_DEBUG"):
            raise
        print(f"glm5 {name}: error: out of memory{f' ({exc})' if str(exc) else ''}: the run needs more than this "
              "machine has; make the model, batch or sequence smaller (GLM5_DEBUG=1 shows where)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
