"""The demo's text summary: what the sampler emitted, dropped, and did with every decoded
token, read off `/v1/stats`."""

from __future__ import annotations

from trainer_client.report import sampling_tables, token_rows

WASTE = {
    "decoded": 1000,
    "trained": 600,
    "downsampled": 100,
    "waste": {"surplus": 0, "aborted": 0, "stale": 250, "prompt_dropped": 30, "crash": 0},
    "pending": 20,
    "redrawn": {"aborted": 3},
}


def test_every_decoded_token_is_shown_with_its_share_and_the_fates_add_up() -> None:
    rows = dict(token_rows(WASTE))
    assert rows["decoded"] == 1000
    assert rows["trained"] == "600 (60.0%)" and rows["waste: stale"] == "250 (25.0%)"
    assert rows["answers drawn again"] == "aborted 3"
    shown = [
        int(str(v).split()[0])
        for k, v in rows.items()
        if k not in ("decoded", "answers drawn again")
    ]
    assert sum(shown) == WASTE["decoded"]


def test_the_summary_says_where_the_decoded_tokens_went_and_the_stale_share() -> None:
    stats = {"groups_emitted": 40, "dropped": {"stale": 6}, "waste": WASTE}
    text = sampling_tables([], stats)
    assert "dropped groups: stale 6 (15.0% of 40 emitted)" in text
    line = next(line for line in text.splitlines() if line.startswith("decoded tokens: "))
    assert "waste: stale 250 (25.0%)" in line and "trained 600 (60.0%)" in line
    assert "decoded tokens" not in sampling_tables([], {"groups_emitted": 1})


def test_a_run_that_dropped_nothing_says_so() -> None:
    text = sampling_tables([], {"groups_emitted": 40, "dropped": {}})
    assert "dropped groups: stale 0 (0.0% of 40 emitted)" in text
    assert "dropped groups" not in sampling_tables([], {})  # nothing emitted, nothing to say
