"""Mermaid ``stateDiagram-v2`` text generated from the tables in ``lifecycle.py`` (never drawn by hand)."""

from __future__ import annotations

from kvoffload_ref import lifecycle
from kvoffload_ref.lifecycle import Action
from kvoffload_ref.tables import Transition

__all__ = ["render", "render_machine"]


def render_machine(name: str) -> str:
    """One machine as a Mermaid state diagram: every legal transition, labelled with its inputs.

    Refused pairs (which raise a typed error and leave the state unchanged) and pure no-op repeats are left out;
    the tables in lifecycle.py list them.
    """
    states, _inputs, table = lifecycle.MACHINES[name]
    edges: dict[tuple[str, str], list[str]] = {}
    for (state, event), entry in table.items():
        if not isinstance(entry, Transition) or entry.action is Action.NOTHING:
            continue
        label = event.name if entry.action is Action.PROCEED else f"{event.name} / {entry.action.name}"
        edges.setdefault((state.name, entry.next.name), []).append(label)
    first = next(iter(states)).name
    lines = ["stateDiagram-v2", f"    %% {name} machine, generated from kvoffload_ref/lifecycle.py",
             f"    [*] --> {first}"]
    for (src, dst), labels in edges.items():
        lines.append(f"    {src} --> {dst}: {', '.join(labels)}")
    return "\n".join(lines) + "\n"


def render() -> str:
    """All three machines, each in a fenced ``mermaid`` block under a heading."""
    parts = []
    for name in lifecycle.MACHINES:
        parts.append(f"### {name}\n\n```mermaid\n{render_machine(name)}```\n")
    return "\n".join(parts)
