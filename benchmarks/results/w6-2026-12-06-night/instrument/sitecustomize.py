"""Scratch instrumentation of a W6 mesh's stages (not part of stagemesh): put this directory
on PYTHONPATH with SCRATCH_PHASES=1 (and SCRATCH_OUT=dir) when running
benchmarks.control_plane. Four seconds after a stage starts, it wraps the step's phases with
thread-CPU and wall timers and the step thread's queue with a probe of waits on an empty
queue, and writes per-step figures every 3 s to phases_<pid>.txt (stage_ev_<pid>.txt: the
empty-queue waits with their monotonic start, from 6 s on)."""

import os
import sys
import threading
import time

OUT = os.environ.get("SCRATCH_OUT", ".")
if (
    os.environ.get("SCRATCH_PHASES")
    and "stage" in sys.argv
    and "--stage-index" in " ".join(sys.argv)
):
    acc = {}

    def wrap(cls, name, label):
        f = getattr(cls, name)
        tt = time.thread_time_ns
        pc = time.perf_counter_ns

        def w(*a, **k):
            t = tt()
            p = pc()
            if label.startswith("A "):
                last = acc.get("_lastend")
                if last is not None:
                    g = acc.setdefault("gap between steps (wall)", [0, 0, 0])
                    g[2] += p - last[0]
                    g[1] += 1
                    if p - last[0] > 200_000:
                        g2 = acc.setdefault("gaps >200us (wall)", [0, 0, 0])
                        g2[2] += p - last[0]
                        g2[1] += 1
            try:
                return f(*a, **k)
            finally:
                d = tt() - t
                e = pc() - p
                c = acc.get(label)
                if c is None:
                    acc[label] = [d, 1, e]
                else:
                    c[0] += d
                    c[1] += 1
                    c[2] += e
                if label.startswith("A "):
                    acc["_lastend"] = [pc()]

        setattr(cls, name, w)

    def install():
        import stage_worker.feedback as F
        import stage_worker.lanes as LN
        import stage_worker.leader as L
        import stage_worker.links as K
        import stage_worker.metrics as M
        import stage_worker.null_runner as N
        import stage_worker.service as S
        import stage_worker.stage_rank as R

        wrap(S.StageServicer, "_run_step", "A run_step total")
        wrap(L.StageLeader, "_receive", "recv activations")
        wrap(R.StageRank, "check", "check")
        wrap(R.StageRank, "step", "rank.step")
        wrap(LN.Lanes, "apply", " lanes.apply")
        wrap(N.NullRunner, "execute", " null.execute")
        wrap(N.NullRunner, "sample", "null.sample")
        wrap(L.StageLeader, "_start_sampling", "start_sampling")
        wrap(L.StageLeader, "_resolve", "resolve")
        wrap(K.DataPlaneLinks, "send", "links.send")
        wrap(K.DataPlaneLinks, "send_feedback", " send_feedback")
        wrap(F.FeedbackStore, "take_aligned", "  fb.take_aligned")
        wrap(F.FeedbackStore, "settle", "fb.settle")
        wrap(M.StageMetrics, "step", "metrics.step")
        wrap(L.StageLeader, "_outcome", "outcome")
        import stage_worker.held_seqs as H
        import stage_worker.step_sampling as SS

        wrap(H.HeldSeqs, "record_sampled", " record_sampled")
        wrap(H.HeldSeqs, "note_sampling", " note_sampling")
        wrap(H.HeldSeqs, "fill_inputs", "  fill_inputs")
        wrap(SS.StepSample, "resolve", " sample.resolve")
        wrap(L.StageLeader, "_late_inputs", "late_inputs (closure)")
        import gc

        import stage_worker.step_thread as ST

        ev = []
        T_REC = time.monotonic() + 6

        class QW:
            def __init__(self, q):
                self.q = q

            def get(self, *a, **k):
                empty = self.q.empty()
                p = time.perf_counter_ns()
                r = self.q.get(*a, **k)
                d = time.perf_counter_ns() - p
                key = "q.get when EMPTY (wall)" if empty else "q.get when nonempty (wall)"
                if empty and time.monotonic() > T_REC:
                    ev.append((p, d))
                    if len(ev) == 400:
                        with open(os.path.join(OUT, f"stage_ev_{os.getpid()}.txt"), "w") as fh:
                            for e in ev:
                                fh.write(f"{e[0]} {e[1]}\n")
                c = acc.setdefault(key, [0, 0, 0])
                c[1] += 1
                c[2] += d
                return r

            def __getattr__(self, n):
                return getattr(self.q, n)

        for o in gc.get_objects():
            if isinstance(o, ST.StepThread):
                o._queue = QW(o._queue)

        def dump():
            while True:
                time.sleep(3)
                steps = acc.get("A run_step total", [0, 1])[1]
                with open(os.path.join(OUT, f"phases_{os.getpid()}.txt"), "w") as fh:
                    fh.write(" ".join(sys.argv[-3:]) + f" steps {steps}\n")
                    for k in sorted(acc):
                        if k.startswith("_"):
                            continue
                        d, n, e = acc[k]
                        per = 1e3 * max(steps, 1)
                        fh.write(f"{k:28s} cpu {d / per:7.1f} us/step  wall {e / per:7.1f} "
                                 f"us/step  calls/step {n / steps:.2f}\n")

        threading.Thread(target=dump, daemon=True).start()

    def later():
        time.sleep(4)
        try:
            install()
        except Exception as e:
            with open(os.path.join(OUT, "phase_err.txt"), "a") as fh:
                fh.write(repr(e) + "\n")

    threading.Thread(target=later, daemon=True).start()
