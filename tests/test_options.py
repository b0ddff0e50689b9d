"""One list of options (``Options``): every entry point takes them with the same names, types, defaults and docs."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
from torch import nn

from lightning_lowmem import LowMemBP, Options, apply_lowmem, max_batch_size, plan

NAMES = [f.name for f in fields(Options)]


@pytest.mark.parametrize("entry", [apply_lowmem, plan, max_batch_size, LowMemBP], ids=lambda e: e.__name__)
def test_every_entry_point_has_every_option_in_its_signature_and_docs(entry):
    parameters = inspect.signature(entry).parameters
    assert set(NAMES) <= set(parameters) and not any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    for name in NAMES:
        assert parameters[name].default == getattr(Options, name) or name == "budget_mib"
        assert f"\n        {name}: " in entry.__doc__, name
    assert "{options}" not in entry.__doc__


def test_options_are_validated_once_with_clear_errors():
    with pytest.raises(TypeError, match="LowMemBP: unknown option 'bit'; the options are activation, attention, bits"):
        LowMemBP(bit=2)
    with pytest.raises(ValueError, match="apply_lowmem: norm must be 'auto', True, False or 'off', got 'yes'"):
        apply_lowmem(nn.Linear(2, 2), norm="yes")
    with pytest.raises(ValueError, match="budget_mib must be a positive number of MiB, got True"):
        Options(budget_mib=True)
    with pytest.raises(TypeError, match="verify must be True or False, got 1"):
        Options(verify=1)
    with pytest.raises(ValueError, match="pattern 'blocks.\\*' matches no module of Linear"):
        apply_lowmem(nn.Linear(2, 2), exclude="blocks.*")
    options = Options(activation="off", include="a.*", bits=4)
    assert (options.activation, options.include, options.bits, options.norm) == (False, ("a.*",), 4, True)


def test_lightning_cli_reads_the_options_with_their_types_and_docs():
    parser = pytest.importorskip("jsonargparse").ArgumentParser()
    parser.add_class_arguments(LowMemBP, "callback")
    config = parser.parse_args(["--callback.bits=4", "--callback.gated=false", "--callback.exclude=[head, 'blocks.0']"])
    assert (
        config.callback.bits == 4 and config.callback.gated is False and config.callback.exclude == ["head", "blocks.0"]
    )
    assert LowMemBP(**vars(config.callback)).options.exclude == ("head", "blocks.0")
    assert (
        " ".join(parser.format_help().split()).count("bits per element of the activations' approximate backward") == 1
    )
