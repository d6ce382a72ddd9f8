"""`keras-parallel launch`: `torchrun` (`torch.distributed.run`) by another name.

`--nproc N` is `--nproc-per-node N`, and `--standalone` (a free local port)
is added when no rendezvous option is given; every other torchrun option
passes through, so its restart and rendezvous options work.
"""

import sys

#: The options that choose a rendezvous; without any, `launch` CLI runs
#: torchrun `--standalone` (a free local port).
_RENDEZVOUS_OPTIONS = (
    "--standalone",
    "--nnodes",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-backend",
    "--rdzv_backend",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
)


def main(argv=None):
    """`keras-parallel launch [--nproc N] [torchrun options] script [args]`.

    A thin layer over `torch.distributed.run` (torchrun): `--nproc N` is
    `--nproc-per-node N`, and `--standalone` is added when no rendezvous
    option is given. Every other torchrun option passes through.

    Args:
        argv: the arguments after `launch`.

    Returns:
        The exit status: 0, or 1 if a rank failed.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: keras-parallel launch [--nproc N] [torchrun options] "
            "script.py [script args]\n\nRuns script.py in N processes with "
            "torch.distributed.run (torchrun); every torchrun option works. "
            "torchrun's own help follows.\n"
        )
        from torch.distributed import run

        run.get_args_parser().print_help()
        return 0
    torchrun_args = _torchrun_args(argv)
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run.run(run.parse_args(torchrun_args))
    except ChildFailedError as error:
        print(f"keras-parallel launch: {error}", file=sys.stderr)
        return 1
    return 0


def _torchrun_args(argv):
    out = []
    i = 0
    script_at = None
    while i < len(argv):
        arg = argv[i]
        if arg == "--nproc" and i + 1 < len(argv):
            out += ["--nproc-per-node", argv[i + 1]]
            i += 2
            continue
        if arg.startswith("--nproc="):
            out.append("--nproc-per-node=" + arg.split("=", 1)[1])
        elif not arg.startswith("-") and (not out or not _takes_value(out[-1])):
            script_at = len(out)
            out += argv[i:]
            break
        else:
            out.append(arg)
        i += 1
    options = out if script_at is None else out[:script_at]
    if not any(o.split("=", 1)[0] in _RENDEZVOUS_OPTIONS for o in options):
        out.insert(0, "--standalone")
    return out


def _takes_value(option):
    # torchrun options that are flags; every other option takes a value.
    flags = {
        "--standalone",
        "--no-python",
        "--no_python",
        "--run-path",
        "--run_path",
        "-m",
        "--module",
    }
    return option.startswith("-") and "=" not in option and option not in flags
