"""Logs every Triton JIT compile (a miss of the kernel's in-memory cache) of every Python
process started with this folder first on PYTHONPATH and COMPILE_LOG set: one line per
compile with its start (epoch seconds), its duration, the pid, the kernel and the
specialization. A compile in a serving process after start-up stalls its step; this finds
which kernel variants first appear under load:

    COMPILE_LOG=/tmp/compiles.log PYTHONPATH=benchmarks/triton_compiles:$PYTHONPATH \\
        python -m benchmarks.serving ...

Not imported by anything in the project; it wraps a private Triton method, so it is a
measuring aid, not a dependency.
"""

import os
import sys
import time

if os.environ.get("COMPILE_LOG"):
    try:
        import triton.runtime.jit as _jit

        _original = _jit.JITFunction._do_compile

        def _do_compile(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.time()
            out = _original(self, *args, **kwargs)
            with open(os.environ["COMPILE_LOG"], "a") as f:
                f.write(f"{start:.3f} {time.time() - start:.3f} pid={os.getpid()} "
                        f"{self.__name__} args={args[1:]!r:.2000} "
                        f"argv={' '.join(sys.argv[1:6])}\n")
            return out

        _jit.JITFunction._do_compile = _do_compile
    except (ImportError, AttributeError) as e:
        print(f"compile log off: {e}", file=sys.stderr)
