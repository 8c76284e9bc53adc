import time, sys
def steal():
    f = open('/proc/stat').readline().split()
    return int(f[8])
def rundelay():
    return int(open('/proc/self/schedstat').read().split()[1])
def faults():
    d = dict(l.split() for l in open('/proc/vmstat'))
    return {k: int(d.get(k, 0)) for k in ('pgfault', 'pgmajfault', 'pgscan_kswapd', 'pgsteal_kswapd', 'pgpgin', 'pswpin', 'workingset_refault_file', 'pgactivate', 'compact_stall', 'thp_fault_alloc')}
end = time.time() + float(sys.argv[1])
prev_s, prev_f = steal(), faults()
prev_r = rundelay()
last = time.monotonic()
while time.time() < end:
    time.sleep(0.01)
    now = time.monotonic()
    late = now - last - 0.01
    if late > 0.1:
        s, f = steal(), faults()
        r = rundelay()
        print(f"{time.strftime('%H:%M:%S')} late {late*1000:.0f} ms rundelay +{(r-prev_r)/1e6:.0f} ms cpu {__import__('os').sched_getaffinity(0)}  steal +{s-prev_s} jiffies " + " ".join(f"{k}+{f[k]-prev_f[k]}" for k in f if f[k]-prev_f[k]), flush=True)
    prev_s, prev_f = steal(), faults()
    prev_r = rundelay()
    last = time.monotonic()
