"""python -m sage_attn.fastpath: build the C++ fast path of the SDPA drop-in, sageattn and the
official-API alias for the installed torch (sage_attn._fastpath has the why and the how)."""
import sys

from ._fastpath import __doc__ as _DOC, build, load


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m sage_attn.fastpath", description=_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verbose", action="store_true", help="print the compile command")
    args = ap.parse_args(argv)
    out = build(verbose=args.verbose)
    if load() is None:
        print(f"built {out}, but it does not load (SAGE_FASTPATH=0?)", file=sys.stderr)
        return 1
    print(f"built {out}; sage_attn uses it from its next import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
