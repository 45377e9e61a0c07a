"""The dashboard picture of docs/dashboard.md (``docs/img/dashboard.png``), drawn by a real browser.

Development tool. It

1. starts ``kvbaton serve`` on loopback with a small KV pool over a host tier and a token (the page
   reads its data with the token in the URL fragment, as a user's browser does);
2. runs a four-agent debate over HTTP: each agent's persona and the shared notes are its registered
   prompt, the step graph (optimist -> skeptic -> pragmatist, ``--rounds`` times, then the judge) gives
   the hints, so the cache evicts the agents due last to the tier and prefetches the next one's prompt;
3. screenshots ``/dashboard`` with Debian's Chromium (``--headless=new --screenshot``), stops the server.

    .venv/bin/python scripts/dashboard_screenshot.py --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import kvbaton
from kvbaton import StepGraph
from kvbaton.bench.corpus import document
from kvbaton.bench.processes import dies_with_parent, free_port, stop_process, wait_healthy

TOKEN = "dashboard-screenshot"
AGENTS = {
    "optimist": "You are the optimist. You argue for the plan and point out what will go well.",
    "skeptic": "You are the skeptic. You look for risks, missing owners and unrealistic dates.",
    "pragmatist": "You are the pragmatist. You propose the smallest next step that settles the question.",
    "judge": "You are the judge. You weigh the arguments and decide.",
}


def debate(client: kvbaton.Client, notes: str, rounds: int, max_tokens: int) -> None:
    graph = StepGraph()
    graph.add_edge("optimist", "skeptic")
    graph.add_edge("skeptic", "pragmatist")
    graph.add_edge("pragmatist", "optimist")
    graph.add_edge("pragmatist", "judge")
    system = {agent: [{"role": "system", "content": f"{persona}\n\nThe team's notes:\n{notes}"}]
              for agent, persona in AGENTS.items()}
    client.hints(graph)
    for agent, messages in system.items():
        client.register_agent(agent, messages, prefill=True)
    transcript: list[str] = []
    turns = [a for _ in range(rounds) for a in ("optimist", "skeptic", "pragmatist")] + ["judge"]
    for agent in turns:
        client.hints(graph, running=[agent])
        ask = "\n".join(transcript[-6:]) + f"\n\n{agent.capitalize()}, your turn, in one sentence."
        result = client.generate([*system[agent], {"role": "user", "content": ask}], agent=agent,
                                 max_tokens=max_tokens, ignore_eos=True)
        transcript.append(f"{agent}: {result.text.strip()}")
        client.release(result.handle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--notes-words", type=int, default=260, help="size of the shared notes")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--kv-budget", default="48MiB", help="small: the four registered prompts do not all fit")
    parser.add_argument("--log", type=Path, help="write the server's log here")
    args = parser.parse_args(argv)
    if shutil.which(args.chromium) is None:
        parser.error(f"no browser at {args.chromium} (Debian: apt-get install chromium)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--port", str(port), "--kv-budget", args.kv_budget,
           "--tier", "host:256MiB", "--token", TOKEN, "--log-level", "warning"]
    log = open(args.log, "wb") if args.log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(dies_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, 180, stop=lambda: stop_process(proc, 10), headers={"Authorization": f"Bearer {TOKEN}"},
                     name="kvbaton serve")
        with kvbaton.connect(url, token=TOKEN) as client:
            debate(client, document(args.notes_words, seed=5), args.rounds, args.max_tokens)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            shot = subprocess.run(
                [args.chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 "--no-first-run", f"--user-data-dir={profile}", "--window-size=1400,860",
                 "--virtual-time-budget=5000", f"--screenshot={args.out.resolve()}", f"{url}/dashboard#token={TOKEN}"],
                check=False, capture_output=True, text=True, timeout=120,
            )
        if shot.returncode != 0:
            print(shot.stderr[-2000:], file=sys.stderr)
            return 1
        print(f"wrote {args.out}")
        return 0
    finally:
        stop_process(proc, 10)


if __name__ == "__main__":
    sys.exit(main())
