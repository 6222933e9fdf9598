"""Reading a llama.cpp example program's output completely: its logger flushed at exit.

llama.cpp's programs print through `common/log.cpp`. A LOG / LOG_INF call only queues the
text; a worker thread prints the queue (LOG to stdout, LOG_INF and the others to stderr). The
logger is a singleton that is never destroyed (`common_log_main`: "intentionally leak", so
its destructor, which would drain the queue, never runs), and `llama-speculative` returns
from `main` without calling `common_log_flush` (log.h: "Call common_log_flush() before exit
if you want to ensure all logs are flushed"). Whatever the worker has not printed when the
process exits is lost. On a busy machine the worker rarely runs during the example's
sub-millisecond generation, so most runs lose their text and statistics; no flag changes
that (`--log-file` is written by the same thread; verbosity, colours, JSONL and a pty only
change what is queued or how it is printed).

So the output is read through the one path the logger guarantees: `common_log_pause`, which
queues an end mark and joins the worker after it has printed everything before the mark.
`library()` builds (once, cached) a small shared library that LD_PRELOAD loads into the
program; at exit its destructor finds `common_log_main` and `common_log_pause` in the
program's own symbol table (the cached builds are not stripped), calls them, then writes
`MARKER` to stderr. The program's code is not changed. Its output is complete exactly when
`MARKER` is on stderr; without it, `problem` says why. Linux only (LD_PRELOAD,
/proc/self/exe); the builds already need the C compiler it is built with.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from specaudit.distribution.results import DistError
from specaudit.paths import cache_root

PREFIX = "specaudit-logflush:"
MARKER = f"{PREFIX} flushed"  # the last line on stderr of a run whose logger was drained

# C, built with the system compiler. Itanium C++ names (GCC and Clang on Linux):
# common_log_main() and common_log_pause(common_log *), from common/log.h.
SOURCE = r"""
#define _GNU_SOURCE
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static void say(const char *s) { ssize_t r = write(2, s, strlen(s)); (void) r; }

static int main_program(struct dl_phdr_info *info, size_t size, void *base) {
    (void) size;
    *(ElfW(Addr) *) base = info->dlpi_addr; /* the first object visited is the program */
    return 1;
}

/* A defined function of the program's .symtab, at its address in this process. */
static void *lookup(const unsigned char *img, size_t len, ElfW(Addr) base, const char *name) {
    const ElfW(Ehdr) *eh = (const void *) img;
    if (len < sizeof *eh || memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 || eh->e_shoff == 0 ||
        eh->e_shoff > len || (len - eh->e_shoff) / sizeof(ElfW(Shdr)) < eh->e_shnum)
        return NULL;
    const ElfW(Shdr) *sh = (const void *) (img + eh->e_shoff);
    for (size_t i = 0; i < eh->e_shnum; i++) {
        if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_link >= eh->e_shnum) continue;
        const ElfW(Shdr) *st = &sh[sh[i].sh_link];
        if (sh[i].sh_offset > len || sh[i].sh_size > len - sh[i].sh_offset ||
            st->sh_offset > len || st->sh_size > len - st->sh_offset || st->sh_size == 0)
            continue;
        const ElfW(Sym) *sym = (const void *) (img + sh[i].sh_offset);
        const char *str = (const char *) (img + st->sh_offset);
        size_t nlen = strlen(name);
        for (size_t j = 0; j < sh[i].sh_size / sizeof(ElfW(Sym)); j++) {
            if (ELF64_ST_TYPE(sym[j].st_info) != STT_FUNC || sym[j].st_shndx == SHN_UNDEF ||
                sym[j].st_name >= st->sh_size || st->sh_size - sym[j].st_name <= nlen)
                continue;
            if (memcmp(str + sym[j].st_name, name, nlen + 1) == 0)
                return (void *) (base + sym[j].st_value);
        }
    }
    return NULL;
}

/* Runs at exit, after the program's own static destructors: drain llama.cpp's logger. */
__attribute__((destructor)) static void specaudit_logflush(void) {
    int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    struct stat s;
    if (fd < 0 || fstat(fd, &s) != 0 || s.st_size <= 0) {
        say("\nspecaudit-logflush: cannot read /proc/self/exe\n");
        if (fd >= 0) close(fd);
        return;
    }
    size_t len = (size_t) s.st_size;
    void *img = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (img == MAP_FAILED) {
        say("\nspecaudit-logflush: cannot map /proc/self/exe\n");
        return;
    }
    ElfW(Addr) base = 0;
    dl_iterate_phdr(main_program, &base);
    void *(*log_main)(void) = (void *(*)(void)) lookup(img, len, base, "_Z15common_log_mainv");
    void (*log_pause)(void *) =
        (void (*)(void *)) lookup(img, len, base, "_Z16common_log_pauseP10common_log");
    munmap(img, len);
    if (!log_main || !log_pause) {
        say("\nspecaudit-logflush: no common_log_main/common_log_pause in the program's symbol "
            "table (a stripped binary?)\n");
        return;
    }
    log_pause(log_main()); /* prints everything queued, then joins the worker */
    say("\nspecaudit-logflush: flushed\n");
}
"""


def _compiler() -> list[str]:
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise DistError("no C compiler (cc, gcc or clang; or set CC)")


@functools.cache
def library() -> Path:
    """The flush library, built on first use into the cache (atomically: concurrent builders
    each write their own file and the last rename wins, all identical)."""
    if not sys.platform.startswith("linux"):
        raise DistError(f"needs Linux (LD_PRELOAD and /proc/self/exe), not {sys.platform}")
    cc = _compiler()
    key = hashlib.sha256("\0".join([SOURCE, *cc, platform.machine()]).encode()).hexdigest()
    d = cache_root() / "logflush"
    out = d / f"logflush-{key[:16]}.so"
    if any(ch in str(out) for ch in ": \t\n"):
        raise DistError(f"{out}: LD_PRELOAD cannot load a path with ':' or whitespace")
    if out.is_file():
        return out
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        src = Path(tmp) / "logflush.c"
        src.write_text(SOURCE)
        built = Path(tmp) / out.name
        try:
            r = subprocess.run(
                [*cc, "-shared", "-fPIC", "-O2", "-o", str(built), str(src)],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DistError(f"cannot build the logger flush library with {cc[0]}: {e}") from None
        if r.returncode != 0 or not built.is_file():
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            raise DistError(
                f"cannot build the logger flush library with {cc[0]}: "
                f"{lines[-1] if lines else f'exit code {r.returncode}'}"
            )
        os.replace(built, out)
    return out


def environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the flush library preloaded first."""
    env = dict(os.environ if base is None else base)
    lib = str(library())
    env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
    return env


def problem(stderr: str) -> str | None:
    """None when the logger was drained at exit (`MARKER` on stderr), else why not."""
    lines = [ln.strip() for ln in stderr.splitlines()]
    if MARKER in lines:
        return None
    said = [ln[len(PREFIX) :].strip() for ln in lines if ln.startswith(PREFIX)]
    if said:
        return f"its logger could not be flushed at exit: {said[-1]}"
    return "its logger was not flushed at exit (the process ended before its exit handlers ran)"


__all__ = ["MARKER", "PREFIX", "SOURCE", "environ", "library", "problem"]
