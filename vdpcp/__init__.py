from vdpcp.third_party import silence_import_notices

# Here rather than at each entry point: the CLI, pytest (through vdpcp's plugin), the rank zygote and the
# ranks it forks all import vdpcp before anything can import megatron.
silence_import_notices()
