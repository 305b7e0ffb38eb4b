# Prints the source lines of a kernel with the most warp-stall samples, from
# `ncu --import REPORT --page source --csv --print-source cuda` (argv[1]; argv[2] = how many).
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
head_i = next(i for i, r in enumerate(rows) if any("Warp Stall Sampling (All" in c for c in r))
head = rows[head_i]
col = next(i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c)
src = next((i for i, c in enumerate(head) if c.strip() in ("Source", "# Source")), 1)
line = next((i for i, c in enumerate(head) if c.strip() in ("#", "Line", "# Address")), 0)
data = []
for r in rows[head_i + 1:]:
    try:
        data.append((float(r[col].replace(",", "")), r[line], r[src].strip()[:110]))
    except (ValueError, IndexError):
        pass
total = sum(d[0] for d in data) or 1
print(f"columns: {head[:6]} ... stall column {head[col]!r}; total samples {total:.0f}")
for v, ln, s in sorted(data, reverse=True)[:top]:
    print(f"{100 * v / total:5.1f}%  {ln:>5}  {s}")
