"""Pictures of a :class:`~lightning_lowmem.PeakMemoryMonitor` summary (``peak_memory.json``).

Drawn from the summary alone, so a finished run's file can be redrawn and tests can check a picture
against its numbers. matplotlib is optional (the ``examples`` and ``test`` extras have it). Figures
are ``matplotlib.figure.Figure`` objects, not pyplot ones, so drawing never switches the user's
backend or leaves figures open.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from lightning_utilities.core.imports import RequirementCache

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib")

# one panel per kind of memory: 7 MiB of activations and 1 GiB of RSS on one axis hide the former
PANELS = {
    "Activations (saved for backward)": ("activation",),
    "Device memory (CUDA)": ("cuda_allocated", "cuda_reserved"),
    "Host memory (process RSS)": ("cpu_rss",),
}
LABELS = {"activation": "activations", "cuda_allocated": "allocated", "cuda_reserved": "reserved", "cpu_rss": "RSS"}
COLORS = {"activation": "C0", "cuda_allocated": "C1", "cuda_reserved": "C2", "cpu_rss": "C4"}
STAGES = {"train": {"linestyle": "-", "marker": "o"}, "val": {"linestyle": "--", "marker": "s"}}
STOCK, CONVERTED, BUDGET = "0.45", "C0", "C3"
OUTSIDE = {"<outside>": "outside the model (loss)", "<root>": "the LightningModule's own forward"}


def epoch_axis(ax: Axes, epochs: list[int]) -> None:
    """Integer epoch ticks, half an epoch of margin (matplotlib would tick 0.5 and pad a lone point oddly)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("epoch")
    ax.set_xlim(min(epochs) - 0.5, max(epochs) + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def epoch_figure(summary: dict[str, Any]) -> Figure | None:
    """Peak MiB per epoch, one panel per kind of memory, with budgets and the stock model's figure.

    Train is solid, validation dashed. With LowMemBP, the activation panel shows the stock model's
    figure as a reference line (``lowmem.stock_activation_mib``) with the saving written on it, or,
    where that figure cannot be estimated, the saving LowMemBP measured at conversion.
    """
    from matplotlib.figure import Figure

    rows = summary["epochs"]
    panels = {
        title: [name for name in names if any(name in row.get(stage, {}) for row in rows for stage in STAGES)]
        for title, names in PANELS.items()
    }
    panels = {title: names for title, names in panels.items() if names}
    if not panels:
        return None
    fig = Figure(figsize=(4.6 * len(panels), 3.8), layout="constrained")
    for ax, (title, names) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels.items()):
        top = 0.0
        for name in names:
            for stage, style in STAGES.items():
                points = [(row["epoch"], row[stage][name]) for row in rows if name in row.get(stage, {})]
                if points:
                    ax.plot(*zip(*points), color=COLORS[name], label=f"{stage} {LABELS[name]}", **style)
                    top = max(top, *(value for _, value in points))
        if "activation" in names:
            top = max(top, _stock_reference(ax, summary), _budget_plan(ax, summary))
        for name in names:
            top = _budget(ax, summary.get("budget_mib", {}).get(name), top)
        ax.set_ylim(0, 1.2 * top or 1.0)  # from zero: a 1% wobble must not look like a cliff
        ax.set(title=title, ylabel="peak MiB")
        epoch_axis(ax, [row["epoch"] for row in rows])
        ax.legend(fontsize="small")
    fig.suptitle(f"Peak memory per epoch ({summary['device']}, precision {summary['precision']})")
    return fig


def _budget(ax: Axes, budget: float | None, top: float) -> float:
    """A budget line; far above the figures only a legend entry (a line at 1000 MiB would flatten 7 MiB)."""
    if budget is None:
        return top
    if budget > 2 * top:
        ax.plot([], [], color=BUDGET, linestyle=":", label=f"budget {budget:g} MiB (off the scale)")
        return top
    ax.axhline(budget, color=BUDGET, linestyle=":", label=f"budget {budget:g} MiB")
    return max(top, budget)


def _stock_reference(ax: Axes, summary: dict[str, Any]) -> float:
    """Draw what LowMemBP saved on the activation panel; return the height it needs."""
    lowmem = summary.get("lowmem", {})
    stock = lowmem.get("stock_activation_mib")
    if stock:
        first = summary["epochs"][0]["train"]["activation"]
        ax.axhline(stock, color=STOCK, linestyle="-.", label="stock model (estimated)")
        text = f"stock model ≈ {stock:.2f} MiB: LowMemBP saves {100 * (1 - first / stock):.1f}%"
        ax.text(0.03, stock, text, color="0.25", transform=ax.get_yaxis_transform(), va="bottom", fontsize="small")
        return stock
    if "reduction" in lowmem:  # the stock figure at this batch is unknown: say what was measured, where
        ax.text(0.03, 0.97, conversion_text(lowmem), color="0.25", transform=ax.transAxes, va="top", fontsize="small")
    return 0.0


def _budget_plan(ax: Axes, summary: dict[str, Any]) -> float:
    """LowMemBP's activation budget and its plan: the forward's saved bytes it predicted (what each epoch's
    figure measures) and, on top, the largest block recomputed in backward."""
    plan = summary.get("lowmem", {}).get("budget")
    if plan is None:
        return 0.0
    ax.axhline(plan["budget_mib"], color=BUDGET, linestyle="--", label=f"LowMemBP budget {plan['budget_mib']:g} MiB")
    label = (
        f"planned: forward {plan['forward_mib']:.2f} MiB (+{plan['recompute_mib']:.2f} recomputed), "
        f"{len(plan['checkpointed'])} blocks checkpointed"
    )
    ax.axhline(plan["forward_mib"], color=CONVERTED, linestyle=":", label=label)
    return plan["budget_mib"]


def conversion_text(lowmem: dict[str, Any]) -> str:
    """What LowMemBP measured at conversion: activations, and autocast's weight copies apart."""
    before = lowmem["saved_mib_before"] - lowmem["weight_copy_mib_before"]
    after = lowmem["saved_mib_after"] - lowmem["weight_copy_mib_after"]
    text = (
        f"LowMemBP at conversion, on {lowmem['probe']}:\n"
        f"activations {before:.2f} → {after:.2f} MiB, saves {100 * lowmem['reduction']:.1f}%"
    )
    if lowmem["weight_copy_mib_before"]:
        text += f"\nautocast's weight copies {lowmem['weight_copy_mib_before']:.2f} → {lowmem['weight_copy_mib_after']:.2f} MiB"
    return text


def module_figure(summary: dict[str, Any], top: int = 15) -> Figure | None:
    """Where activation memory goes: the largest modules as horizontal bars, stock vs converted.

    Modules of repeated blocks are summed (``blocks.*.attn ×12``), so a 12-block model shows 12
    kinds of module rather than 12 copies of one. With LowMemBP's per-module breakdowns at
    conversion (``lowmem.saved_by_module_before_mib`` / ``_after_mib``) the bars compare the stock
    and the converted model on the same input; otherwise they show this run's first epoch. Each
    bar says what LowMemBP did to its modules, and why it left one alone.
    """
    from matplotlib.figure import Figure

    lowmem = summary.get("lowmem", {})
    if "saved_by_module_before_mib" in lowmem and "saved_by_module_after_mib" in lowmem:
        series = {
            "stock model": lowmem["saved_by_module_before_mib"],
            "with LowMemBP": lowmem["saved_by_module_after_mib"],
        }
        measured = f"one forward on {lowmem.get('probe') or 'the example input'}, measured by LowMemBP at conversion"
    elif summary.get("modules_first_epoch_mib"):
        series = {"this run": summary["modules_first_epoch_mib"]}
        measured = "largest sampled training step of the first epoch"
    else:
        return None
    role = _roles({name for by_module in series.values() for name in by_module})
    count = Counter(role.values())
    sums = {label: _sum_by(by_module, role) for label, by_module in series.items()}
    largest = {r: max(by_role.get(r, 0.0) for by_role in sums.values()) for r in count}
    ranked = sorted(largest, key=largest.__getitem__, reverse=True)
    shown, rest = ranked[:top], ranked[top:]
    labels = [f"{r} ×{count[r]}" if count[r] > 1 else OUTSIDE.get(r, r) for r in shown]
    labels += [f"{len(rest)} more kinds"] * bool(rest)

    fig = Figure(figsize=(10, 1.4 + 0.38 * len(labels)), layout="constrained")
    ax = fig.subplots()
    height = 0.8 / len(sums)
    totals = {label: sum(by_role.values()) for label, by_role in sums.items()}
    first = next(iter(totals.values()))
    for i, (label, by_role) in enumerate(sums.items()):
        values = [by_role.get(r, 0.0) for r in shown] + [sum(by_role.get(r, 0.0) for r in rest)] * bool(rest)
        saved = f" (-{100 * (1 - totals[label] / first):.1f}%)" if i else ""
        offsets = [y + (i - (len(sums) - 1) / 2) * height for y in range(len(labels))]
        color = STOCK if label == "stock model" else CONVERTED
        ax.barh(offsets, values, height, color=color, label=f"{label}: {totals[label]:.2f} MiB{saved}")
    notes = _notes(lowmem.get("entries", []), role, count)
    for y, r in enumerate(shown):
        if r in notes:
            text, color = notes[r]
            ax.text(largest[r] + 0.01 * largest[shown[0]], y, text, va="center", fontsize="small", color=color)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.7 * largest[shown[0]] or 1.0)  # room for the notes
    ax.set_xlabel("MiB saved for backward")
    ax.legend(loc="lower right", fontsize="small")
    fig.suptitle(f"Where activation memory goes (top {len(shown)} kinds of module, repeated blocks summed)\n{measured}")
    return fig


def _roles(names: set[str]) -> dict[str, str]:
    """Each module name without the common prefix, block indices as ``*`` (``blocks.3.attn`` -> ``blocks.*.attn``).

    An index is a block index when more of the name follows it: ``net.0`` and ``net.2`` of a
    Sequential stay apart.
    """
    split = {name: name.split(".") for name in names if not name.startswith("<")}
    common = os.path.commonprefix(list(split.values())) if split else []
    common = common[: min((len(parts) for parts in split.values()), default=1) - 1]
    if any(parts[len(common)].isdigit() for parts in split.values()):
        common = common[:-1]  # keep the name of the list the index is in: blocks.*, not *
    roles = {name: name for name in names if name not in split}  # <root>, <outside>
    for name, parts in split.items():
        parts = parts[len(common) :]
        roles[name] = ".".join("*" if part.isdigit() and i < len(parts) - 1 else part for i, part in enumerate(parts))
    return roles


def _sum_by(values: dict[str, float], role: dict[str, str]) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    for name, value in values.items():
        sums[role[name]] += value
    return dict(sums)


def _notes(entries: list[dict[str, str]], role: dict[str, str], count: Counter[str]) -> dict[str, tuple[str, str]]:
    """Per role, what LowMemBP did: the new module, or why it left some alone (that note wins)."""
    converted: dict[str, set[str]] = defaultdict(set)
    left_alone: dict[str, list[str]] = defaultdict(list)
    for entry in entries:
        name = role.get(entry["name"])
        if name is None:  # a module that saved nothing
            continue
        if entry["status"] == "left alone":
            left_alone[name].append(entry["detail"])
        else:
            converted[name].add(entry["detail"].split(",")[0])
    notes = {name: ("→ " + ", ".join(sorted(kinds)), "C2") for name, kinds in converted.items()}
    for name, reasons in left_alone.items():
        some = f" ({len(reasons)} of {count[name]})" if len(reasons) < count[name] else ""
        notes[name] = (f"left alone{some}: " + "; ".join(sorted(set(reasons))), "C3")
    return notes
