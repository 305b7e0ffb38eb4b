# Compare per-kernel SASS of two cuobjdump -sass dumps, normalized: addresses, encodings and
# constant-bank offsets of c[0x0][...] (kernel parameters) removed. Kernels matched by
# (arch, name, template args) from the demangled names.
import re, subprocess, sys, collections

def parse(path, norm_params=True):
    arch = None; cur = None; funcs = {}
    for line in open(path):
        m = re.search(r'arch = (sm_\w+)', line)
        if m: arch = m.group(1); continue
        m = re.match(r'\s+Function : (\S+)', line)
        if m:
            cur = (arch, m.group(1)); funcs[cur] = []; continue
        if cur is None: continue
        if '/*' not in line or not re.search(r'/\*[0-9a-f]{4}\*/', line): continue
        s = re.sub(r'/\*[0-9a-f]{4,}\*/', '', line)
        s = re.sub(r'/\* 0x[0-9a-f]+ \*/', '', s)
        if norm_params:
            s = re.sub(r'c\[0x0\]\[0x[0-9a-f]+\]', 'c[0x0][P]', s)
            # code addresses (branch and call targets, return addresses): they move with any
            # instruction added or removed before them
            s = re.sub(r'\b(BRA|CALL\.REL\.NOINC|CALL\.REL|BSSY|BREAK|SSY|PBK|JMP)(.*?)0x[0-9a-f]+', r'\1\2ADDR', s)
            s = re.sub(r'^(\s*MOV R\d+, )0x[0-9a-f]+ ;', r'\1ADDR ;', s)
            if re.match(r'\s*NOP ;', s): continue
        s = ' '.join(s.split())
        if s: funcs[cur].append(s)
    return funcs

def key(arch, mangled):
    d = subprocess.run(['c++filt', mangled], capture_output=True, text=True).stdout.strip()
    m = re.search(r'(\w+_kernel)<(.*?)>\(', d)
    return (arch, m.group(1), m.group(2)) if m else (arch, d, '')

def keyed(f):
    out = {}
    for (arch, name), ins in f.items():
        k = key(arch, name); assert k not in out, k; out[k] = ins
    return out

norm = len(sys.argv) < 4 or sys.argv[3] != 'raw'
a = keyed(parse(sys.argv[1], norm)); b = keyed(parse(sys.argv[2], norm))
print('kernels: base', len(a), 'new', len(b))
print('only in base:', sorted(set(a) - set(b)))
print('only in new:', sorted(set(b) - set(a)))
same = diff = 0
per_arch = collections.Counter()
for k in sorted(set(a) & set(b)):
    if a[k] == b[k]: same += 1; per_arch[k[0]] += 1
    else:
        diff += 1
        print('DIFF', k, len(a[k]), len(b[k]))
print('identical', same, 'different', diff, dict(per_arch))

if len(sys.argv) > 4:
    import difflib
    want = tuple(sys.argv[4].split('|'))
    for k in a:
        if k == want:
            sys.stdout.writelines(l + '\n' for l in difflib.unified_diff(a[k], b[k], 'base', 'new', n=2))
