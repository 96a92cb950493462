"""Typed command configs: each command's settings are one dataclass, and its flags are made from
the fields (`add_arguments`), so flags and fields cannot drift apart.

    @dataclass
    class LayerBenchConfig:
        config: str = arg("tiny", "layer config name")
        steps: int = arg(20, "timed rounds", parse=positive_int)

    add_arguments(subparser, LayerBenchConfig)          # --config, --steps
    cfg = from_namespace(LayerBenchConfig, namespace)   # LayerBenchConfig(config=..., steps=...)

A field `tokens_per_rank` is the flag `--tokens-per-rank`; `parse` turns the flag's text into the
field's value (argparse's `type`), `choices` limits it. Command-specific checks live in each
config's `validate()`, which raises ValueError naming the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ACTIVATION_CHOICES = ("relu", "gelu", "silu", "swiglu")
GATE_CHOICES = ("topk", "bpr", "cosine", "expert_choice", "random")


def arg(default: Any, help: str, *, parse: Callable[[str], Any] | None = None,
        choices: tuple | list | None = None) -> Any:
    """A config field that is also a flag: its default, help text, parser and choices."""
    factory = {"default_factory": lambda: default} if isinstance(default, (list, dict)) else {"default": default}
    return dataclasses.field(**factory, metadata={"help": help, "parse": parse, "choices": choices})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One flag per field of `config_cls`, with the field's default, parser, choices and help."""
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict[str, Any] = {"default": default, "help": meta.get("help", "")}
        if f.type in (bool, "bool") and default is False:  # a switch: --name sets it
            parser.add_argument(flag(f.name), dest=f.name, action="store_true", **kwargs)
            continue
        if meta.get("parse") is not None:
            kwargs["type"] = meta["parse"]
        if meta.get("choices") is not None:
            kwargs["choices"] = list(meta["choices"])
        parser.add_argument(flag(f.name), dest=f.name, **kwargs)


def from_namespace(config_cls: type, ns: argparse.Namespace):
    """The config whose fields are the parsed flags of the same names."""
    return config_cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(config_cls)})


# -- flag parsers: text -> value, argparse.ArgumentTypeError naming what was wrong -----------------
def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def on_off(text: str) -> bool:
    """"on" or "off", as a bool."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"must be on or off, got {text!r}")
    return text == "on"


def names(text: str) -> tuple[str, ...]:
    """Comma-separated names, blanks dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def capacity(text: str) -> float | None:
    """A capacity factor: a number, or 'dropless' (also 'none') for None."""
    if text in ("none", "dropless"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity factors are numbers or 'dropless', got {text!r}") from None


def capacity_list(text: str) -> tuple[float | None, ...]:
    return tuple(capacity(item.strip()) for item in text.split(","))


def capacity_or_preset(text: str) -> float | str | None:
    """'preset' keeps the model preset's capacity factor; otherwise as `capacity`."""
    return text if text == "preset" else capacity(text)


def byte_sizes(text: str) -> list[int]:
    """Comma-separated byte counts like 1024, 64K or 256M."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for item in text.split(","):
        item = item.strip().lower().removesuffix("ib").removesuffix("b")
        try:
            out.append(int(float(item[:-1]) * units[item[-1]]) if item and item[-1] in units else int(item))
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"sizes are bytes like 1024, 64K or 256M, got {item!r}") from None
    return out


@dataclass
class LaunchConfig:
    """Where a command runs when it is not under torchrun (`weft.cli.launch`)."""

    nproc: int = arg(2, "CPU processes when not under torchrun", parse=positive_int)
    device: str | None = arg(None, "cpu or cuda (default: cuda when a GPU is visible)", choices=("cpu", "cuda"))
