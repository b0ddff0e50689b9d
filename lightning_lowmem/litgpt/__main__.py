"""``python -m lightning_lowmem.litgpt <command> <LitGPT's arguments> [--lowmem.<option> <value> ...]``.

``command``: ``finetune_lora`` (``finetune``), ``finetune_full``, ``finetune_adapter`` or ``finetune_adapter_v2``,
with exactly the arguments ``litgpt <command>`` takes; ``--lowmem.<option>`` sets an option of
:func:`~lightning_lowmem.apply_lowmem` (``--lowmem.head false``, ``--lowmem.exclude 'transformer.h.0.*'``).
The options also go to the environment (``LIGHTNING_LOWMEM_LITGPT``), and LitGPT's arguments alone to ``sys.argv``:
LitGPT re-reads ``sys.argv`` to save its hyperparameters, and Fabric starts the processes of ``--devices 2`` with it,
so that every rank patches alike.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import yaml

from lightning_lowmem.litgpt.finetune import COMMANDS, check_litgpt, patch, script
from lightning_lowmem.surgery import Options

PREFIX = "--lowmem."
ENVIRONMENT = "LIGHTNING_LOWMEM_LITGPT"


def split_options(argv: list[str]) -> tuple[dict[str, object], list[str]]:
    """``--lowmem.<option> <value>`` (or ``=<value>``) pairs, values read as YAML, and the other arguments."""
    options, rest, i = {}, [], 0
    while i < len(argv):
        argument = argv[i]
        if not argument.startswith(PREFIX):
            rest.append(argument)
            i += 1
            continue
        name, equals, value = argument[len(PREFIX) :].partition("=")
        if not equals:
            if i + 1 == len(argv):
                raise SystemExit(f"lightning_lowmem.litgpt: {argument} needs a value")
            value, i = argv[i + 1], i + 1
        options[name.replace("-", "_")] = yaml.safe_load(value)
        i += 1
    return options, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().split("\n\n")[0].replace("``", "") + f"\n\ncommands: {', '.join(COMMANDS)}")
        return
    command, (options, rest) = argv[0], split_options(argv[1:])
    options = {**json.loads(os.environ.get(ENVIRONMENT, "{}")), **options}
    check_litgpt()
    patch(script(command), Options.parse(options, "lightning_lowmem.litgpt"))
    os.environ[ENVIRONMENT] = json.dumps(options)
    sys.argv = [sys.argv[0], command, *rest]
    from jsonargparse import CLI, set_docstring_parse_options
    from litgpt.__main__ import PARSER_DATA

    # as litgpt's own main: its docstrings document the arguments, and a lr_scheduler warning is a false positive
    set_docstring_parse_options(attribute_docstrings=True)
    warnings.filterwarnings("ignore", r"The epoch parameter in `scheduler.step\(\)` was not necessary", UserWarning)
    CLI({command: PARSER_DATA[command]}, args=[command, *rest])


if __name__ == "__main__":
    main()
