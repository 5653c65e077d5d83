"""Verifiers and the verifier pool, with real worker processes.

Misbehaving verifiers come from `sampler_service.verifiers.testing`, which worker
processes import by package name (no sys.path set-up needed).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from sampler_service.verifiers import resolve
from sampler_service.verifiers.pool import VerifierPool

pytestmark = pytest.mark.timeout(60)

T = "python:sampler_service.verifiers.testing:"


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("82", "82", 1.0),
        (" 82.0\n", "82", 1.0),
        ("82.", "82", 1.0),
        ("8.2e1", "82", 1.0),
        ("-0", "0", 1.0),
        ("Paris", "paris.", 1.0),
        ("83", "82", 0.0),
        ("82 apples", "82", 0.0),
        ("", "82", 0.0),
        ("nan", "NaN.", 1.0),  # equal as strings, although NaN != NaN as numbers
        ("inf", "1e999", 0.0),
    ],
)
def test_exact(response: str, answer: str, reward: float) -> None:
    assert resolve("exact")(response, answer, None) == reward


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("\\frac{1}{2}", "0.5", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("so the answer is \\boxed{\\frac{1}{2}}.", "1/2", 1.0),
        ("$\\sqrt{2}$", "\\sqrt{2}", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("no idea", "4", 0.0),
    ],
)
def test_math(response: str, answer: str, reward: float) -> None:
    assert resolve("math")(response, answer, None) == reward


def test_resolve() -> None:
    from sampler_service.verifiers import testing

    assert resolve(T + "fail") is testing.fail
    for bad in ("nope", "python:", "python:sampler_service.verifiers.testing", T + "missing"):
        with pytest.raises(ValueError):
            resolve(bad)
    with pytest.raises(ImportError):
        resolve("python:no_such_module_here:fn")


@pytest.fixture
async def pool() -> AsyncIterator[VerifierPool]:
    pool = VerifierPool(max_workers=2, timeout_s=1.0)
    yield pool
    pool.close()


async def test_pool_runs_builtin_and_python_verifiers(pool: VerifierPool) -> None:
    math, exact, meta = await asyncio.gather(
        pool.verify("math", "\\boxed{\\frac{1}{2}}", "0.5"),
        pool.verify("exact", "82.0", "82"),
        pool.verify(T + "metadata_reward", "x", "y", {"reward": 0.25}),
    )
    assert (math.reward, math.error) == (1.0, None)
    assert (exact.reward, exact.error) == (1.0, None)
    assert (meta.reward, meta.error) == (0.25, None)
    assert pool.stats.calls == 3 and pool.stats.errors == 0
    assert all(v.seconds > 0 for v in (math, exact, meta))


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("fail", "RuntimeError: verifier failed on purpose"),
        ("out_of_range", "verifier returned 2.0, not a reward in [0, 1]"),
        ("not_a_number", "verifier returned 'yes', not a reward in [0, 1]"),
        ("exit_process", "verifier worker died (exit code 3)"),
    ],
)
async def test_a_failing_verifier_is_a_failed_verdict_not_a_reward_and_the_pool_goes_on(
    pool: VerifierPool, name: str, error: str
) -> None:
    """A verifier that raises, returns no reward or kills its worker has failed: its
    verdict says so (the scheduler asks it again, then drops the prompt), it is never
    an answer scored 0."""
    verdict = await pool.verify(T + name, "42", "42")
    assert verdict.kind != "ok"
    assert verdict.error is not None and verdict.error.startswith(error)
    crashed = name == "exit_process"  # a dead worker is a crash, counted apart from errors
    assert (pool.stats.errors, pool.stats.crashes) == (int(not crashed), int(crashed))
    assert verdict.kind == ("crash" if crashed else "error") and pool.stats.timeouts == 0
    assert (await pool.verify("math", "42", "42")).reward == 1.0


async def test_hung_verifier_times_out_and_its_worker_is_replaced(pool: VerifierPool) -> None:
    await asyncio.gather(*(pool.verify("math", "1", "1") for _ in range(2)))  # start both
    before = pool.worker_pids()
    hung = asyncio.create_task(pool.verify(T + "hang", "1", "1"))
    # While one worker hangs, the other keeps serving (and the event loop keeps running):
    # the answer comes back while the hung call is still waiting out its timeout.
    assert (await pool.verify("math", "2", "2")).reward == 1.0
    assert not hung.done()

    verdict = await hung
    assert verdict.kind == "timeout" and verdict.error is not None
    assert verdict.error.startswith("timeout")
    assert 1.0 <= verdict.seconds < 3 * 1.0 + 30  # the 1 s limit, with a generous ceiling
    killed = next(pid for pid in before if pid not in pool.worker_pids())
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)  # SIGKILLed and reaped, not left running

    # Both slots serve again, the replaced one included, with no time limit left over:
    # no further call times out.
    verdicts = await asyncio.gather(*(pool.verify("math", "3", "3") for _ in range(4)))
    assert [v.reward for v in verdicts] == [1.0] * 4
    assert None not in pool.worker_pids() and killed not in pool.worker_pids()
    assert (pool.stats.timeouts, pool.stats.restarts, pool.stats.errors) == (1, 1, 0)


async def test_a_wave_goes_to_each_free_worker_in_one_message_and_a_hung_answer_costs_itself(
    pool: VerifierPool,
) -> None:
    handed: list[list[str]] = []
    submit = pool._threads.submit

    def counted(fn, request, *args):  # type: ignore[no-untyped-def]
        handed.append(request[1])
        return submit(fn, request, *args)

    pool._threads.submit = counted  # type: ignore[method-assign]
    verdicts = await pool.verify_wave("math", ["1", "2", "3", "4"], "2")
    assert [v.reward for v in verdicts] == [0.0, 1.0, 0.0, 0.0]
    assert handed == [["1", "2"], ["3", "4"]]  # both workers free: half the wave each
    # The answer after the hung one goes to the replaced worker; the others are not held.
    verdicts = await pool.verify_wave(T + "hang_on_hang", ["hang", "1", "1", "2"], "1")
    assert [v.kind for v in verdicts] == ["timeout", "ok", "ok", "ok"]
    assert [v.reward for v in verdicts[1:]] == [1.0, 1.0, 0.0]
    assert (pool.stats.calls, pool.stats.timeouts, pool.stats.restarts) == (8, 1, 1)
    assert len(handed) == 4
    assert await pool.verify_wave("math", [], "1") == [] and len(handed) == 4


async def test_close_ends_calls_in_progress(pool: VerifierPool) -> None:
    hung = asyncio.create_task(pool.verify(T + "hang", "1", "1"))
    await asyncio.sleep(0.3)
    pool.close()
    verdict = await hung
    assert verdict.kind != "ok" and verdict.error is not None
    with pytest.raises(RuntimeError):
        await pool.verify("exact", "1", "1")


async def test_specs_are_checked_in_a_worker(pool: VerifierPool) -> None:
    assert await pool.check("math") is None
    assert await pool.check(T + "fail") is None
    assert "no_such_module_here" in (await pool.check("python:no_such_module_here:fn") or "")
    assert "missing" in (await pool.check(T + "missing") or "")
    assert "unknown verifier" in (await pool.check("nope") or "")


async def test_a_hanging_spec_opens_its_breaker_and_others_go_on() -> None:
    """Time-outs past the share open the spec's breaker: its calls are refused at once
    (kind "unavailable", so the scheduler drops the prompt) and /health is warned;
    another spec is not affected."""
    pool = VerifierPool(max_workers=2, timeout_s=0.3)
    try:
        verdicts = [await pool.verify(T + "hang", "1", "1") for _ in range(2)]
        assert [v.kind for v in verdicts] == ["timeout", "timeout"]
        refused = await pool.verify(T + "hang", "1", "1")
        assert refused.kind == "unavailable"
        assert pool.stats.unavailable == 1 and pool.stats.timeouts == 2
        assert any(T + "hang" in w and "time-outs" in w for w in pool.warnings())
        assert (await pool.verify("math", "2", "2")).reward == 1.0
    finally:
        pool.close()


async def test_a_spec_that_mostly_fails_is_warned_about(pool: VerifierPool) -> None:
    for _ in range(20):
        await pool.verify(T + "fail", "1", "1")
    assert any(T + "fail" in w and "100%" in w for w in pool.warnings())
    assert not any("math" in w for w in pool.warnings())
