"""The README's "Coming from verl" table, generated from VERL_KEYS."""

from __future__ import annotations

from recipes.from_verl.keys import VERL_KEYS, Key


def _same_name_prefixes(row: Key) -> tuple[str, str] | None:
    """(verl prefix, lorarl prefix) when the two keys end in the same name, else None."""
    verl, ours = row.verl.split("."), row.to.split(".")
    n = 0
    while n < min(len(verl), len(ours)) and verl[-1 - n] == ours[-1 - n]:
        n += 1
    return (".".join(verl[: len(verl) - n]), ".".join(ours[: len(ours) - n])) if n else None


def _plain(row: Key) -> bool:
    return bool(row.to) and not (row.note or row.values or row.only or row.convert or row.verl.endswith(".*"))


def markdown_table() -> str:
    """Keys that keep their name under another prefix, one line per prefix; renamed keys and
    keys with a note, one line each; keys accepted with some values only, one line each;
    ignored keys, one line per reason."""
    lines = ["| verl | lorarl | note |", "|---|---|---|"]
    same: dict[tuple[str, str], list[str]] = {}
    for k in VERL_KEYS:
        prefixes = _same_name_prefixes(k) if _plain(k) else None
        if prefixes:
            same.setdefault(prefixes, []).append(k.verl[len(prefixes[0]) :].lstrip("."))
    for (verl_prefix, ours), names in same.items():
        where = (
            f"`{ours}.` + the same name" if ours else "the same name" + (" without the prefix" if verl_prefix else "")
        )
        keys = ", ".join(f"`{n}`" for n in names)
        lines.append(f"| {f'`{verl_prefix}.` + ' if verl_prefix else ''}{keys} | {where} | |")
    listed = {f"{p}.{n}".lstrip(".") for (p, _), names in same.items() for n in names}
    for k in VERL_KEYS:
        if k.to and k.verl not in listed:
            only = f"only {' / '.join(f'`{v}`' for v in k.only)}; " if k.only else ""
            lines.append(f"| `{k.verl}` | `{k.to}` | {only}{k.note} |")
    for k in VERL_KEYS:
        if k.only and not k.to:
            lines.append(f"| `{k.verl}` | only {' / '.join(f'`{v}`' for v in k.only)}, ignored | {k.note} |")
    reasons: dict[str, list[str]] = {}
    for k in VERL_KEYS:
        if k.to is None and not k.only:
            reasons.setdefault(k.note, []).append(k.verl)
    for reason, keys in reasons.items():
        lines.append(f"| {', '.join(f'`{v}`' for v in keys)} | ignored | {reason} |")
    return "\n".join(lines) + "\n"
