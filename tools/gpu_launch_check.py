"""Launching on a GPU machine, through dtnb's public names: `detect()` leaves CUDA uninitialised, so the next `launch`
still forks its ranks; once this process has run `torch.export` and a backward (PyPI's CUDA builds then run
autograd's device threads, and forked ranks would die at their first backward), launches start from the fork server,
the first and the later ones timed. Step `launch` of tools/gpu_check.sh.

    python tools/gpu_launch_check.py [--out FILE.json] [--device cpu]

On a GPU the ranks run there, one per GPU (nccl). `--device cpu` (tools/gpu_check.sh --dry-run) runs 2 CPU ranks on
gloo: the same checks, no GPU figure. Exit 1 when a check failed; each result is written to --out as soon as known.
"""
import argparse, json, os, statistics, sys, time, traceback, warnings
from pathlib import Path
import torch
import torch.distributed as dist
import dtnb
from dtnb.launcher.starts import choose_start_method


def where():
    "This rank's device, an all-reduce on it, and its parent process (this script, or the fork server)"
    t = torch.ones(1, device=dtnb.current_device()); dist.all_reduce(t)
    return dict(device=str(t.device), sum=t.item(), parent=os.getppid())


def timed_launch(nprocs, device):
    "(seconds, results, the start method and its reason) of one launch"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        method = choose_start_method(None)
        t = time.perf_counter()
        res = dtnb.launch(where, nprocs=nprocs, device=device)
    why = [str(w.message) for w in said if 'starts the ranks' in str(w.message)]
    return time.perf_counter() - t, res, method, why[:1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--out', default='launch.json'); ap.add_argument('--device', default=None)
    a = ap.parse_args()
    gpus = torch.cuda.device_count() if a.device != 'cpu' else 0
    nprocs, device = (gpus, None) if gpus else (2, 'cpu')
    out, failed = dict(torch=torch.__version__, gpus=gpus, nprocs=nprocs), []
    def save(): Path(a.out).write_text(json.dumps(out, indent=2))

    def check(name, fn):
        try: out[name] = fn()
        except Exception as e:
            failed.append(name); out[name] = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        save(); print(name, json.dumps(out[name])[:400], flush=True)

    def detected():
        info = dtnb.detect()
        r = dict(cuda_initialised=torch.cuda.is_initialized(), devices=len(getattr(info, 'devices', []) or []))
        assert not r['cuda_initialised'], "detect() initialised CUDA in this process: forked ranks could not use it"
        return r

    def after_detect():  # a notebook that asked detect() first can still fork its ranks
        s, res, method, why = timed_launch(nprocs, device)
        assert [r['sum'] for r in res] == [float(nprocs)] * nprocs, res
        assert method == 'fork' and all(r['parent'] == os.getpid() for r in res), (method, why, res)
        return dict(method=method, seconds=s, devices=[r['device'] for r in res])

    def after_backward():  # the CUDA builds' hazard: from the fork server, once started; milliseconds a launch after
        torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
        torch.nn.Linear(2, 2)(torch.zeros(1, 2)).sum().backward()
        runs = [timed_launch(nprocs, device) for _ in range(4)]
        methods, parents = {m for _, _, m, _ in runs}, {r['parent'] for _, res, _, _ in runs for r in res}
        hazards = dtnb.fork_hazards()
        if hazards: assert methods == {'forkserver'} and len(parents) == 1 and os.getpid() not in parents, runs
        else: assert methods == {'fork'}, runs  # the CPU wheel: nothing makes fork unsafe
        return dict(hazards=hazards, method=methods.pop(), why=runs[0][3], first_s=runs[0][0],
                    later_s=statistics.median(s for s, *_ in runs[1:]))

    for name, fn in (('detect', detected), ('launch_after_detect', after_detect), ('launch_after_backward',
                                                                                      after_backward)):
        check(name, fn)
    print("launch check:", "FAILED " + ', '.join(failed) if failed else "passed")
    return 1 if failed else 0


if __name__ == '__main__': sys.exit(main())
