"""An evaluation in words: its verdict line and its markdown artifact.

The verdict is one line, the artifact's first:

    tuned beats base on held-out: 18/20 vs 3/20, p = 0.0002; controls: 1 regression of 10

"beats" and "is worse than" are said only when McNemar's p is below the plan's
alpha; otherwise the line says the difference is not significant. The markdown
then lists the flips, the per-item table (every cell escaped: `|`, newlines,
backticks, `<`), the pass rates with their intervals, the perplexity, the
judge, and what repeats the evaluation (seed, quant, both GGUFs' SHA-256,
versions).
"""

from __future__ import annotations

from overbrainer_prefect.evaluation.results import EvaluationResult, GroupResult, ItemResult

CELL_CHARS = 160  # characters of an answer shown in a table cell; the rest is in results.json


def format_p(p: float) -> str:
    """A p-value as the verdict writes it: `p = 0.0002`, `p = 0.03`, `p = 1`, `p < 0.0001`."""
    if p < 0.0001:
        return "p < 0.0001"
    if p < 0.01:
        return f"p = {p:.1g}" if p < 0.001 else f"p = {p:.3f}".rstrip("0")
    text = f"{p:.2f}".rstrip("0").rstrip(".")
    return f"p = {text}"


def heldout_phrase(group: GroupResult, alpha: float) -> str:
    """`tuned beats base on held-out: 18/20 vs 3/20, p = 0.0002` and its variants."""
    tuned, base = group.tuned, group.base
    counts = (
        f"{tuned.passed}/{tuned.total} vs {base.passed}/{base.total}, {format_p(group.p_value)}"
    )
    significant = group.p_value < alpha
    if tuned.passed > base.passed:
        how = "beats base" if significant else "is ahead of base, not significantly,"
    elif tuned.passed < base.passed:
        how = "is worse than base" if significant else "is behind base, not significantly,"
    elif group.fail_to_pass or group.pass_to_fail:
        how = "matches base in count, with items flipped both ways,"
    else:
        how = "matches base"
    return f"tuned {how} on held-out: {counts}"


def controls_phrase(group: GroupResult | None) -> str:
    """`controls: 1 regression of 10` (`no regression`, `2 regressions`), or `no controls`."""
    if group is None:
        return "no controls"
    down = len(group.pass_to_fail)
    what = "no regression" if down == 0 else f"{down} regression{'s' if down > 1 else ''}"
    return f"controls: {what} of {group.tuned.total}"


def verdict(result: EvaluationResult) -> str:
    """The evaluation's verdict, one line: held-out, controls, and the judge if any."""
    line = (
        f"{heldout_phrase(result.heldout, result.plan.alpha)}; {controls_phrase(result.controls)}"
    )
    judge = result.judge
    if judge is not None and judge.win_rate is not None:
        line += f"; judge prefers tuned {judge.win_rate:.0%} of {judge.judged}"
    return line


def cell(text: str, limit: int = CELL_CHARS) -> str:
    """`text` made safe for one markdown table cell: cut at `limit` characters,
    `|` and backticks escaped, `<` as `&lt;`, newlines as `<br>`."""
    if len(text) > limit:
        text = text[: limit - 1].rstrip() + "…"
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`").replace("<", "&lt;")
    return text.replace("\r\n", "\n").replace("\n", "<br>") or " "


def _mark(passed: bool, cut: bool) -> str:
    return ("pass" if passed else "FAIL") + (" (cut)" if cut else "")


def _flips(result: EvaluationResult) -> list[str]:
    by_id = {item.id: item for item in result.items}
    lines = ["## Flips", ""]
    groups = [g for g in (result.heldout, result.controls) if g is not None]
    any_flip = False
    for group in groups:
        name = "held-out" if group.group == "heldout" else "controls"
        for label, ids in (
            ("fail → pass", group.fail_to_pass),
            ("pass → fail", group.pass_to_fail),
        ):
            if not ids:
                continue
            any_flip = True
            lines.append(f"**{name}, {label}** ({len(ids)}):")
            lines.append("")
            lines += [f"- {i}: {cell(by_id[i].prompt, 100)}" for i in ids]
            lines.append("")
    if not any_flip:
        lines += ["No item flipped: both models passed and failed the same items.", ""]
    return lines


def _row(item: ItemResult) -> str:
    expected = f"{cell(item.expected, 80)} ({item.scorer}"
    expected += f" ± {item.tolerance:g})" if item.scorer == "numeric" and item.tolerance else ")"
    judge = f"{item.judge_score:.2g}" if item.judge_score is not None else "-"
    return (
        f"| {item.id} | {cell(item.prompt, 100)} | {expected} | "
        f"{_mark(item.base_pass, item.base_cut)}: {cell(item.base_answer)} | "
        f"{_mark(item.tuned_pass, item.tuned_cut)}: {cell(item.tuned_answer)} | {judge} |"
    )


def _rates(result: EvaluationResult) -> list[str]:
    level = f"{result.plan.confidence:.0%}"
    lines = [
        "## Pass rates",
        "",
        f"| group | base | tuned | base→tuned flips | McNemar p | ({level} Wilson intervals) |",
        "|---|---|---|---|---|---|",
    ]
    for group in (result.heldout, result.controls):
        if group is None:
            continue
        rates = [
            f"{r.passed}/{r.total} = {r.rate:.0%} [{r.low:.0%}, {r.high:.0%}]"
            for r in (group.base, group.tuned)
        ]
        flips = f"+{len(group.fail_to_pass)} −{len(group.pass_to_fail)}"
        name = "held-out" if group.group == "heldout" else "controls"
        lines.append(f"| {name} | {rates[0]} | {rates[1]} | {flips} | {group.p_value:.4g} | |")
    return [*lines, ""]


def markdown(result: EvaluationResult) -> str:
    """The evaluation artifact: the verdict on its first line, then the flips, the
    per-item table, the pass rates, the perplexity, the judge, and how to repeat it."""
    plan = result.plan
    lines = [verdict(result), "", *_flips(result)]
    lines += [
        "## Items",
        "",
        "| # | prompt | expected (scorer) | base | tuned | judge |",
        "|---|---|---|---|---|---|",
        *(_row(item) for item in result.items),
        "",
        *_rates(result),
    ]
    if result.perplexity:
        base, tuned = result.perplexity.get("base"), result.perplexity.get("tuned")
        if base is not None and tuned is not None:
            lines += [
                "## Held-out perplexity",
                "",
                f"base {base.perplexity:.3f}, tuned {tuned.perplexity:.3f} on the same "
                f"{base.texts} held-out answers ({base.tokens} tokens), each given its prompt.",
                "",
            ]
    judge = result.judge
    if judge is not None:
        rate = f"{judge.win_rate:.0%}" if judge.win_rate is not None else "-"
        lines += [
            "## Judge",
            "",
            f"{cell(judge.judge)}: tuned preferred {rate} of {judge.judged} held-out items "
            f"(both orders asked, ties half): {judge.wins} won, {judge.ties} tied or split, "
            f"{judge.losses} lost; {judge.split_orders} split by position, "
            f"{judge.unreadable} unreadable replies.",
            "",
        ]
    versions = ", ".join(f"{k} {v}" for k, v in sorted(result.versions.items())) or "-"
    lines += [
        "## To repeat it",
        "",
        f"- seed {plan.seed}, greedy (temperature 0), at most {plan.max_tokens} tokens an answer",
        f"- quant {plan.quant}; base model {cell(plan.base_model)}",
        f"- base GGUF `{plan.base.path}` sha256 `{plan.base.sha256}`",
        f"- tuned GGUF `{plan.tuned.path}` sha256 `{plan.tuned.sha256}`",
        f"- held-out split: {plan.heldout_split or 'none (eval file or items only)'}",
        f"- versions: {versions}",
        "",
    ]
    return "\n".join(lines)
