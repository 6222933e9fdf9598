"""llama-server, started on a model and always stopped (the lifecycle is
`specaudit.llama.process.ManagedServer`'s: loopback on a free port, a log file, its own process
group with PDEATHSIG, ready when started, stopped on exit).

Why a subclass of its own: llama-server's command line (model, draft, speculation type,
slots, context) and what must exist before it starts (the model files and the binary) are all
that differ from any other managed server.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specaudit.errors import ServerError
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.process import ManagedServer, free_port, log_tail, stop_process_group

__all__ = ["LlamaServer", "free_port", "log_tail", "stop_process_group"]


class LlamaServer(ManagedServer):
    """A llama-server process bound to 127.0.0.1:<free port>, ready when `__enter__` returns.

    ``with LlamaServer(bins, model, draft=d, spec_type="draft-simple") as srv: srv.url``
    """

    def __init__(
        self,
        binaries: LlamaBinaries,
        model: Path,
        *,
        draft: Path | None = None,
        spec_type: str | None = None,
        parallel: int = 1,
        ctx_size: int | None = None,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        startup_timeout: float = 120.0,
        name: str = "llama-server",
    ) -> None:
        super().__init__(name=name, log_path=log_path, startup_timeout=startup_timeout)
        self.binaries = binaries
        self.model = Path(model)
        self.draft = Path(draft) if draft else None
        self.spec_type = spec_type
        self.parallel = parallel
        self.ctx_size = ctx_size
        self.extra_args = list(extra_args)

    @property
    def speculates(self) -> bool:
        """Whether we asked it to speculate (the server's own word is in /slots)."""
        return self.spec_type not in (None, "none")

    def argv(self) -> list[str]:
        args = [
            str(self.binaries.server),
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "-np",
            str(self.parallel),
            "--no-webui",
        ]
        if self.ctx_size is not None:
            args += ["-c", str(self.ctx_size)]
        if self.draft is not None:
            args += ["-md", str(self.draft)]
        if self.spec_type:
            args += ["--spec-type", self.spec_type]
        return args + self.extra_args

    def preflight(self) -> None:
        if not self.model.is_file():
            raise ServerError(f"model file not found: {self.model}")
        if self.draft is not None and not self.draft.is_file():
            raise ServerError(f"draft model file not found: {self.draft}")
        if not self.binaries.server.is_file():
            raise ServerError(f"llama-server binary not found: {self.binaries.server}")
