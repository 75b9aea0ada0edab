"""What the GPU check's tools share: one named check run, timed, and its failure kept as figures, never raised.

A tool's checks run one after the other; one that fails must not cost the figures of the others, nor those it had
before it failed, since a borrowed GPU slot may not come back (tools/gpu_check.sh)."""
import json, time, traceback


def run_check(name:str, fn, checks:dict, error_key:str='error', show:int=400) -> dict:
    """`fn()` (a dict of figures) as check `name`, into `checks[name]`: passed, its figures, seconds; a failure's
    `error_key` ("Type: message") and traceback instead. Prints one line; returns the check's dict"""
    t0 = time.perf_counter()
    try: res = dict(passed=True, **fn())
    except Exception as e:
        res = {'passed': False, error_key: f"{type(e).__name__}: {e}", 'traceback': traceback.format_exc()}
    res['seconds'] = round(time.perf_counter() - t0, 2)
    checks[name] = res
    print(f"{name}: {'passed' if res['passed'] else 'FAILED'} in {res['seconds']} s;",
          json.dumps({k: v for k, v in res.items() if k != 'traceback'}, default=str)[:show], flush=True)
    if not res['passed']: print(res['traceback'], flush=True)
    return res
