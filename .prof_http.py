import cProfile, pstats, sys, threading
sys.argv=["x"]
sys.path.insert(0, "scripts"); import bench_scheduler_host as b
import uvicorn
orig = uvicorn.Server.run
prof = cProfile.Profile()
def run(self, *a, **k):
    prof.enable()
    try: return orig(self, *a, **k)
    finally: prof.disable()
uvicorn.Server.run = run
if __name__ == "__main__":
  r = b.run_http(16, 3, 32, "bytes", stream=bool(int(__import__('os').environ.get("STREAM","0"))), step_ms=0)
  print(r["host_ms_per_step"], r["decode_steps"])
  pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
