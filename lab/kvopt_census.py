"""Offline SASS of the decode kernel's plain builds (not registered: the census has their window and
softcap variants only) and of its KV-cache option builds (``KernelSpec.batch_idx``, ``leftpad``,
``rotary``),
in ``benchmarks/sass_census.py``'s line format (``name@arch registers instructions ldl stl call``),
so that ``sass_census.py --compare`` reads two runs. Runs on code without the options too (then
the plain builds only): compare a branch's plain builds with main's.

    PYTHONPATH=<tree> python lab/kvopt_census.py --match d128 --archs sm_90a,sm_80 --out x.tsv

``--sass-hashes FILE`` also writes each kernel's SASS text digest (its mangled name left out:
Numba numbers the functions a process builds): two trees' plain builds compared instruction for
instruction.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def specs(match: str) -> list:
    from numbaflash.configs import shipped_decode_configs
    from numbaflash.kernels.families import spec_of
    from numbaflash.kernels.spec import KernelSpec

    fields = {f.name for f in dataclasses.fields(KernelSpec)}
    options = [{}]
    if "batch_idx" in fields:
        options += [{"batch_idx": True}, {"leftpad": True}, {"batch_idx": True, "leftpad": True}]
    if "rotary" in fields:
        options += [{"rotary": 1}, {"rotary": 2}, {"batch_idx": True, "leftpad": True, "rotary": 1}]
    found = []
    for config in shipped_decode_configs():
        for causal in (False, True):
            for bf16 in (False, True):
                for option in options:
                    spec = spec_of(config, "decode", bf16, causal=causal)
                    found.append(dataclasses.replace(spec, **option))
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--match", default="")
    parser.add_argument("--archs", default="sm_90a,sm_80")
    parser.add_argument("--options-only", action="store_true")
    parser.add_argument("--plain-only", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--sass-hashes", help="also write 'name@arch md5' of each kernel's SASS text here")
    args = parser.parse_args()
    import hashlib

    from numbaflash.kernels.families import kernel_argtypes, make_kernel
    from numbaflash.tools.inspect import inspect_kernel

    out = open(args.out, "w") if args.out else sys.stdout
    hashes = open(args.sass_hashes, "w") if args.sass_hashes else None
    seen = set()
    for spec in specs(""):
        kernel = make_kernel(spec)
        name = kernel.__name__
        if args.match not in name or name in seen:
            continue
        option = name.endswith(("_bidx", "_lpad", "_rope", "_ropei"))
        if (args.options_only and not option) or (args.plain_only and option):
            continue
        seen.add(name)
        for arch in args.archs.split(","):
            report = inspect_kernel(kernel, kernel_argtypes(spec), arch, name)
            print(f"{name}@{arch} {report.registers} {sum(report.opcodes.values())} {report.count('LDL')} "
                  f"{report.count('STL')} {report.calls}", file=out, flush=True)
            if hashes:
                # without the mangled name, whose suffix counts the functions the process built
                text = "\n".join(line for line in report.sass.splitlines() if "Function :" not in line)
                digest = hashlib.md5(text.encode()).hexdigest()
                print(f"{name}@{arch} {digest}", file=hashes, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
