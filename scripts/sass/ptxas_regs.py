# ptxas -v: registers, spills, smem per (arch, kernel, template args)
import re, sys, subprocess
def parse(path):
    out = {}; cur = None
    for line in open(path):
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            d = subprocess.run(['c++filt', m.group(1)], capture_output=True, text=True).stdout.strip()
            k = re.search(r'(\w+_kernel)<(.*?)>\(', d)
            cur = (m.group(2), k.group(1), k.group(2)); out[cur] = ''; continue
        if cur and ('spill' in line or 'Used' in line):
            s = re.sub(r'\d+ bytes cmem\[0\]', '', line.split('info    :')[-1]).strip()
            out[cur] += s + ' | '
    return out
a, b = parse(sys.argv[1]), parse(sys.argv[2])
same = 0
for k in sorted(set(a) | set(b)):
    if a.get(k) == b.get(k): same += 1
    else: print(k, '\n  base:', a.get(k), '\n  new: ', b.get(k))
print('same', same, 'of', len(set(a) | set(b)))
