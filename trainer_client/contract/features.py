"""Wire features a consumer declares it handles: `?features=no_text,...` on the stream
and lease routes.

A query parameter, not a body field: the lease body refuses unknown keys, so a new client
would fail against an older server, while a query parameter an older server does not know
is ignored there. A consumer that declares nothing gets groups exactly as before, so every
new wire field (or field left out) is opt-in for the consumer that understands it.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Groups come without answer and prompt texts (`Sample.response_text` and
#: `Group.prompt_text` are None): a trainer that trains on token ids needs neither, and
#: the texts are about a third of a group's bytes.
NO_TEXT = "no_text"

#: Samples may be episodes of several turns: `Sample.loss_mask` is 0 on the tokens an
#: environment's observations put in the response, which must not be trained on. A
#: sampler that serves episodes refuses (409 `feature_required`) a consumer that did not
#: declare it, rather than hand it tokens it would train on by mistake.
LOSS_MASK = "loss_mask"

#: Groups may hold a replayed answer (`Sample.replayed`): an earlier right answer of the
#: prompt, sampled by an older policy, put into a group whose answers were all wrong. A
#: sampler that replays refuses (409 `feature_required`) a consumer that did not declare
#: it, rather than let it train on an off-policy answer as if it were fresh.
REPLAYED = "replayed"

#: Samples may have been decoded under several policy versions (`Sample.version_spans`):
#: a weight update in `continue` mode let them go on decoding under the new weights. A
#: sampler in that mode refuses (409 `feature_required`) a consumer that did not declare
#: it, rather than let it take such an answer's logprobs for one policy's.
VERSION_SPANS = "version_spans"

#: Every feature this version knows.
FEATURES: frozenset[str] = frozenset({NO_TEXT, LOSS_MASK, REPLAYED, VERSION_SPANS})

#: The query parameter that carries them.
QUERY_PARAM = "features"


class UnknownFeatures(ValueError):
    """Feature names this version does not know (`names`, sorted)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = sorted(set(names))
        super().__init__(
            f"unknown feature{'s' if len(self.names) > 1 else ''} {', '.join(self.names)} "
            f"(known: {', '.join(sorted(FEATURES))})"
        )


def parse(values: Iterable[str]) -> frozenset[str]:
    """The features named by query values, each a comma-separated list (`no_text,x`);
    `UnknownFeatures` names any this version does not know."""
    names = {name.strip() for value in values for name in value.split(",")} - {""}
    if unknown := names - FEATURES:
        raise UnknownFeatures(unknown)
    return frozenset(names)


def query_value(features: Iterable[str]) -> str:
    """The query value that declares `features` (checked: a typo fails here, not later)."""
    return ",".join(sorted(parse(features)))
