"""The session agent: runs inside a session sandbox as ``python -I -S -c <this file's text>``.

It keeps the protocol (``trident.sandbox.bwrap.AgentProcess``) on private duplicates of fds 0/1,
points fds 0/1/2 at /dev/null and two memfds that capture each call's output (Python ``print``,
child processes and bash alike), runs Python code in one persistent namespace (echoing the value
of a trailing expression, like a REPL) and bash code in one persistent ``bash`` (sourced from a
file, so syntax errors cannot desynchronise it). Standard library only: site-packages are hidden.
"""

import ast
import json
import os
import resource
import signal
import sys


def main():
    req = os.fdopen(os.dup(0), "rb")
    resp = os.dup(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    out_fd, err_fd = os.memfd_create("stdout"), os.memfd_create("stderr")
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    state = {"ns": {"__name__": "__main__", "__builtins__": __builtins__}, "bash": None}

    def send(obj):
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(resp, data) :]

    send({"ready": True})
    for line in req:
        msg = json.loads(line)
        if msg["op"] == "init":
            for res, key in (
                (resource.RLIMIT_AS, "as_bytes"),
                (resource.RLIMIT_NPROC, "nproc"),
                (resource.RLIMIT_NOFILE, "nofile"),
                (resource.RLIMIT_FSIZE, "fsize"),
            ):
                resource.setrlimit(res, (msg[key], msg[key]))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            send({"ok": True})
            continue
        for fd in (1, 2):
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, 0)
        if msg["kind"] == "bash":
            code = run_bash(state, msg["code"])
        else:
            code = run_python(state["ns"], msg["code"])
        cap = msg["max_output"]
        texts, truncated = [], False
        for fd in (1, 2):
            size = os.fstat(fd).st_size
            truncated = truncated or size > cap
            texts.append(os.pread(fd, min(size, cap), 0).decode("utf-8", "replace"))
        send({"exit_code": code, "stdout": texts[0], "stderr": texts[1], "truncated": truncated})


def run_python(ns, code):
    exit_code = 0
    try:
        tree = ast.parse(code, "<session>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
            ast.fix_missing_locations(last)
        exec(compile(tree, "<session>", "exec"), ns)
        if last is not None:
            value = eval(compile(last, "<session>", "eval"), ns)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        import traceback

        tb = exc.__traceback__
        traceback.print_exception(type(exc), exc, tb.tb_next if tb is not None else None)
        exit_code = 1
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        for stream in (sys.stdout, sys.stderr):
            try:  # noqa: SIM105 (the agent imports as little as it can: it starts per session)
                stream.flush()  # pyright: ignore[reportOptionalMemberAccess] (None: caught)
            except Exception:
                pass
    return exit_code


def run_bash(state, code):
    import subprocess

    if state["bash"] is None:
        status_r, status_w = os.pipe()
        proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            pass_fds=(status_w,),
            cwd=os.getcwd(),
        )
        os.close(status_w)
        state["bash"] = (proc, os.fdopen(status_r, "rb"), status_w)
    proc, status, status_w = state["bash"]
    path = "/tmp/.trident-session-cmd.sh"
    with open(path, "w") as f:
        f.write(code + "\n")
    try:
        proc.stdin.write(f"source {path} </dev/null; printf '%d\\n' $? >&{status_w}\n".encode())
        proc.stdin.flush()
        line = status.readline()
    except BrokenPipeError:
        line = b""
    if line.strip():
        return int(line)
    rc = proc.wait()
    state["bash"] = None
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    main()
