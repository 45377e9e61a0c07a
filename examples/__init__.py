"""Runnable examples, installed as ``kvbaton.examples`` so that ``kvbaton run <example>`` finds them
after a plain ``pip install``. Each module has ``main(argv) -> dict`` and runs as a script too
(``python examples/debate.py``). See docs/examples.md."""

EXAMPLES = {
    "debate": "3 debaters with distinct personas and a judge over a shared ~1.5K-token context (LangGraph)",
    "tree_of_thought": "root context materialized once, forked into k branches, each scored, the best expanded",
    "rag": "planner -> retriever -> k solvers sharing the evidence -> synthesizer (AutoGen GraphFlow)",
    "wrap_existing_langgraph_app": "an unmodified ChatOpenAI LangGraph app on kvbaton with one wrap() line",
}
"""``kvbaton run`` names: each is the module ``kvbaton.examples.<name>`` with ``main(argv)``."""
