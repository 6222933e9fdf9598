"""Record real llama-server responses for the logprobs schema tests.

Usage: ``python tests/data/responses/record.py NAME=URL ...`` with servers started the way
`specaudit.llama.presets.PRESETS` describes (fixture-plain, fixture-spec, gemma-plain, gemma-spec,
gemma-ngram). Writes ``check-<NAME>.json`` next to this file: ``/slots``, ``/props`` and, per probe
(chat, completions, native, native-post), the request body, the non-streamed response and the
raw SSE text of the streamed one. Responses are stored untouched.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from specaudit.check.probes import PROBE_KINDS, PROBE_PATHS, CheckSettings, request_body

HERE = Path(__file__).parent
FIXTURE_PROMPT = "bcdbc"
GEMMA_PROMPT = "Explain how a CPU branch predictor works."
NGRAM_PROMPT = "Write the sentence 'I will not talk in class.' ten times, one per line."


def record(name: str, url: str) -> dict[str, object]:
    if name == "gemma-ngram":
        s = CheckSettings(tokens=48, prompt=NGRAM_PROMPT, temperature=0.0)
        kinds: tuple[str, ...] = ("chat",)
    elif name.startswith("gemma"):
        s = CheckSettings(tokens=24, prompt=GEMMA_PROMPT)
        kinds = PROBE_KINDS
    else:
        s = CheckSettings(tokens=8, prompt=FIXTURE_PROMPT)
        kinds = PROBE_KINDS
    out: dict[str, object] = {"server": name}
    with httpx.Client(timeout=300) as h:
        out["slots"] = h.get(url + "/slots").json()
        out["props"] = h.get(url + "/props").json()
        for kind in kinds:
            body = request_body(kind, s)
            r = h.post(url + PROBE_PATHS[kind], json=body)
            r.raise_for_status()
            # a fresh connection per stream: llama-server closes it after a streamed reply
            with httpx.Client(timeout=300) as h2:
                sr = h2.post(url + PROBE_PATHS[kind], json={**body, "stream": True})
                sr.raise_for_status()
            out[kind] = {"request": body, "response": r.json(), "stream_sse": sr.text}
    return out


def main(argv: list[str]) -> None:
    for arg in argv:
        name, url = arg.split("=", 1)
        data = record(name, url.rstrip("/"))
        (HERE / f"check-{name}.json").write_text(
            json.dumps(data, indent=1, ensure_ascii=False) + "\n"
        )
        print(f"{name}: recorded check-{name}.json")


if __name__ == "__main__":
    main(sys.argv[1:])
