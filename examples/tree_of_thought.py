"""Tree of thought: a root context materialized once, forked into k branches, each branch's idea
scored, the best one expanded, ``--depth`` times; then a final answer from the best path.

kvbaton mode works on handles: ``materialize`` the root once, ``fork`` the current node into k
zero-copy branches, ``resume`` each with its idea prompt (only those few tokens are prefilled),
score each idea by resuming its handle, keep the best and release the rest.

``--baseline text`` runs the same search with text passing: every idea and every score is a plain
completion of the whole path so far (root context included), prefilled from scratch. Decoding is
greedy, so both modes produce the same ideas, scores and answer.

    python examples/tree_of_thought.py --k 3 --depth 2 --baseline both
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from kvbaton.bench.corpus import document
from kvbaton.examples.common import KVBATON, MeteredClient, Report, connect, run_example, say

PROBLEM = ("The notes above describe a team under pressure. Propose a plan that cuts the backlog in half within "
           "a month without hurting reliability. Think step by step.")
STRATEGIES = ["focus on automation", "focus on people", "focus on process", "focus on priorities",
              "focus on tooling", "focus on quick wins", "focus on risk", "focus on customers"]
SCORE_PROMPT = "\nOn a scale from 1 to 10, how good is this idea? Rating:"
ANSWER_PROMPT = "\nFinal plan in one sentence:"


def parse_score(text: str) -> int:
    """The first number 1..10 in the scorer's output (0 when it wrote none: a tiny model may not)."""
    match = re.search(r"\b(10|[1-9])\b", text)
    return int(match.group(1)) if match else 0


def idea_prompt(depth: int, branch: int) -> str:
    return f"\nStep {depth + 1}, idea {branch + 1} ({STRATEGIES[branch % len(STRATEGIES)]}):"


def run_mode(mode: str, args: argparse.Namespace) -> Report:
    client: MeteredClient = connect(mode)
    notes = {"role": "system", "content": "Team notes:\n" + document(args.context_words, seed=5)}
    root_tokens = client.chat_tokens([notes, {"role": "user", "content": PROBLEM}])
    if not args.quiet:
        print(f"\n[{mode}] root context: {len(root_tokens)} tokens; k={args.k} branches, depth {args.depth}")
    thought = {"max_tokens": args.max_tokens, "ignore_eos": True}
    short = {"max_tokens": 3, "ignore_eos": True}
    tok = client.tokenize
    client.start()

    path = list(root_tokens)  # the text of the best path so far, as token ids (text mode)
    node = client.materialize(root_tokens, agent="root") if mode == KVBATON else None
    trail: list[str] = []
    for depth in range(args.depth):
        scored = []
        branches = client.fork(node, args.k) if node is not None else [None] * args.k
        for i, branch in enumerate(branches):
            suffix = tok(idea_prompt(depth, i))
            if branch is not None:
                idea = client.resume(branch, suffix, agent="thinker", **thought)
                rating = client.resume(idea.handle, tok(SCORE_PROMPT), agent="scorer", **short)
            else:
                idea = client.complete(path + suffix, agent="thinker", **thought)
                rating = client.complete(path + suffix + idea.token_ids + tok(SCORE_PROMPT), agent="scorer",
                                         **short)
            score = parse_score(rating.text)
            say(args.quiet, f"d{depth + 1}.{i + 1} score {score}", idea.text)
            scored.append((score, -i, suffix, idea, rating))
        score, neg_i, suffix, best, _ = max(scored, key=lambda s: (s[0], s[1]))
        trail.append(f"d{depth + 1}: idea {-neg_i + 1} (score {score})")
        path = path + suffix + best.token_ids
        if node is not None:
            # keep the best idea's handle; the node and the other branches are done
            client.release([node, *branches, *(s[3].handle for s in scored if s[3] is not best),
                            *(s[4].handle for s in scored)])
            node = best.handle
    if node is not None:
        answer = client.resume(node, tok(ANSWER_PROMPT), agent="answer", **thought)
    else:
        answer = client.complete(path + tok(ANSWER_PROMPT), agent="answer", **thought)
    say(args.quiet, "answer", answer.text)
    report = client.report(mode, {"path": "; ".join(trail), "answer": answer.text})
    client.close()
    return report


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--k", type=int, default=3, help="branches per expansion (default 3)")
    parser.add_argument("--depth", type=int, default=2, help="expansions (default 2)")


def _check(args: argparse.Namespace) -> str | None:
    return None if 1 <= args.k <= len(STRATEGIES) * 4 and args.depth >= 1 else "need 1 <= k <= 32 and depth >= 1"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_example("tree_of_thought", __doc__, argv, max_tokens=20, arguments=_arguments, run_mode=run_mode,
                       check=_check, context_words=600, context="the root context")


if __name__ == "__main__":
    main(sys.argv[1:])
