// Shim for the CPU emulator (tests/kernels/gpu_emu.py): stands in for HIP's hip_runtime.h.
#include "../emu_runtime.h"
