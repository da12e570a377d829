// Shim for the CPU emulator (tests/kernels/gpu_emu.py): stands in for HIP's hip_fp16.h.
#include "../emu_runtime.h"
