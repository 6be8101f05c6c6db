//! The `cuda` GPU backend (feature `cuda`): device KV buffers in GPU memory,
//! the pinned pool registered with the driver once, batched scattered
//! copies in both directions, and a save's slot checksums computed on the
//! device beside the copy.
//!
//! How a batch moves (numbers: H200, docs/BENCHMARKS.md):
//!
//! - **Staged** (default, fragments below [`CudaConfig::dma_min_bytes`]): a
//!   save's fragments are gathered by a kernel into a device staging slot
//!   laid out like the host extents (HBM speed), then each host-contiguous
//!   run (a whole block, often several adjacent blocks) is moved by the copy
//!   engine; a load does the reverse (copy engine into a slot, scatter
//!   kernel out of it). Slots rotate per direction ([`CudaConfig::staging_slots`]
//!   × [`CudaConfig::staging_bytes`]), the next chunk's kernel overlapping
//!   the previous chunk's copy, ordered by events on the device. The copy
//!   engines reach the raw pinned peak and run both directions at once;
//!   one `cuMemcpyAsync` per 32 KiB fragment would be host-bound at
//!   ≈ 10 GB/s, and the driver's batched copy reached 20–28 GB/s from Rust
//!   (both measured on the H200 before this backend was written).
//! - **Direct**: runs of at least `dma_min_bytes` (contiguous layouts) go to
//!   the copy engine straight from/to the device buffer, adjacent runs
//!   merged.
//! - **Zero-copy** (`staging_bytes = 0`, session 1's design, kept for
//!   comparison): one kernel reads/writes the pinned pool through its mapped
//!   (UVA) address, launched in parts of [`CudaConfig::launch_pieces`] while
//!   the table is still written. It tops out near 0.88 of the raw copy for
//!   32 KiB fragments and ≈ 0.6 of the bidirectional peak with a save and a
//!   load at once (SM traffic over PCIe).
//!
//! Kernels read a descriptor table `(src, dst, len)` in pinned mapped memory
//! (reused across batches), one thread block per ≤ 64 KiB piece, 16-byte
//! accesses when aligned, a grid of [`CudaConfig::blocks_per_sm`] per SM.
//!
//! Checksums (C10): a save asks for the CRC-32C of every slot. Reading the
//! pool again on the CPU after the copy halved save throughput, so a second
//! kernel, on its own stream, checksums the *device* bytes of every piece
//! (HBM reads, far below the PCIe time) and the host folds the piece CRCs
//! into slot CRCs ([`super::crc`], where the arithmetic is unit-tested
//! against a CPU model of this kernel).
//!
//! Completion: a batch is enqueued by a blocking worker thread (kept across
//! batches) that then waits on events and hands the host buffers back. The
//! buffers live in that worker until the GPU is done, so a dropped
//! completion future never frees memory a copy still touches (C11).
//!
//! Start-up errors are values: no libcuda / libnvrtc, no device, or a driver
//! too old for the CUDA 13.0 API become [`GpuError::Unavailable`] (cudarc
//! would panic at the first call into a missing library, so presence is
//! checked first).
//!
//! Device-direct copies from a peer engine's buffers (CUDA IPC, C19) live
//! in [`ipc`].
//!
//! Not under the simulator: feature `cuda` only, which `lib.rs` refuses in a
//! `--cfg madsim` build.

mod ipc;

use std::sync::{Arc, Mutex};

pub use ipc::{CudaPeerBuffer, HOST_REGISTER_PIECE_BYTES, peer_checks, time_raw_peer_copy};

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, result};

use super::crc::{self, PIECE_BYTES_MAX, RangeFolder, RangeIndex};
use super::peer::{self, PeerKind};
use super::{
    BatchPin, BufferTable, Completed, Completion, CopyBatch, Direction, ExternalMemoryError, Gpu, GpuError, HostBuf,
    KvMemory, pin_and_validate,
};
use crate::memory::DeviceBufferId;

/// Threads per block of both kernels (the checksum kernel needs exactly
/// `crc::CHUNKS_PER_PIECE`).
const THREADS: u32 = crc::CHUNKS_PER_PIECE as u32;

const KERNELS: &str = r#"
extern "C" __global__ void kvferry_copy(const unsigned long long* __restrict__ desc, unsigned long long n,
                                        unsigned long long src_base, unsigned long long dst_base) {
    for (unsigned long long op = blockIdx.x; op < n; op += gridDim.x) {
        unsigned long long src = src_base + desc[3 * op], dst = dst_base + desc[3 * op + 1], len = desc[3 * op + 2];
        if (((src | dst | len) & 15ull) == 0) {
            const uint4* s = (const uint4*)src;
            uint4* d = (uint4*)dst;
            unsigned long long nv = len >> 4, k = threadIdx.x, b = blockDim.x;
            for (; k + 3 * b < nv; k += 4 * b) {
                uint4 v0 = s[k], v1 = s[k + b], v2 = s[k + 2 * b], v3 = s[k + 3 * b];
                d[k] = v0; d[k + b] = v1; d[k + 2 * b] = v2; d[k + 3 * b] = v3;
            }
            for (; k < nv; k += b) d[k] = s[k];
        } else {
            const unsigned char* s = (const unsigned char*)src;
            unsigned char* d = (unsigned char*)dst;
            for (unsigned long long k = threadIdx.x; k < len; k += blockDim.x) d[k] = s[k];
        }
    }
}

__device__ __forceinline__ unsigned int kv_mulmod(unsigned int a, unsigned int b) {
    unsigned int p = 0;
    for (unsigned int m = 0x80000000u; m; m >>= 1) {
        if (a & m) p ^= b;
        b = (b >> 1) ^ (0x82F63B78u & (0u - (b & 1u)));
    }
    return p;
}

#define KV_STEP(w) crc ^= (w); crc = t[768 + (crc & 255u)] ^ t[512 + ((crc >> 8) & 255u)] ^ t[256 + ((crc >> 16) & 255u)] ^ t[crc >> 24];

// Raw CRC-32C of each piece (desc[3p] = device address, desc[3p+1] = its
// index in `out`, desc[3p+2] = bytes, at most 256 * 256): thread t checksums bytes [256t, 256t+256); see crc.rs.
extern "C" __global__ void kvferry_crc(const unsigned long long* __restrict__ desc, unsigned long long n,
                                       unsigned int* __restrict__ out, const unsigned int* __restrict__ tables) {
    __shared__ unsigned int t[1024];
    __shared__ unsigned int warp_x[32];
    __shared__ unsigned int last_crc;
    for (unsigned int i = threadIdx.x; i < 1024; i += blockDim.x) t[i] = tables[i];
    __syncthreads();
    const unsigned int* chunk_shift = tables + 1024;
    const unsigned int* byte_shift = tables + 1280;
    for (unsigned long long p = blockIdx.x; p < n; p += gridDim.x) {
        unsigned long long src = desc[3 * p], len = desc[3 * p + 2];
        unsigned int last = (unsigned int)((len + 255) >> 8) - 1;
        unsigned int tid = threadIdx.x;
        unsigned int crc = 0;
        if (tid <= last) {
            unsigned long long b = (unsigned long long)tid << 8;
            unsigned long long m = len - b < 256 ? len - b : 256;
            const unsigned char* s = (const unsigned char*)(src + b);
            unsigned long long k = 0;
            if (((src + b) & 15ull) == 0) {
                for (; k + 16 <= m; k += 16) {
                    uint4 q = *(const uint4*)(s + k);
                    KV_STEP(q.x) KV_STEP(q.y) KV_STEP(q.z) KV_STEP(q.w)
                }
            }
            for (; k < m; k++) crc = t[(crc ^ s[k]) & 255u] ^ (crc >> 8);
        }
        unsigned int v = tid < last ? kv_mulmod(crc, chunk_shift[last - 1 - tid]) : 0u;
        if (tid == last) last_crc = crc;
        for (int o = 16; o > 0; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
        if ((tid & 31u) == 0) warp_x[tid >> 5] = v;
        __syncthreads();
        if (tid == 0) {
            unsigned int prefix = 0;
            for (unsigned int w = 0; w < (blockDim.x >> 5); w++) prefix ^= warp_x[w];
            unsigned int r = (unsigned int)(len - ((unsigned long long)last << 8));
            out[desc[3 * p + 1]] = kv_mulmod(prefix, byte_shift[r]) ^ last_crc;
        }
        __syncthreads();
    }
}

// Copy and raw CRC-32C in one pass (peer copies; see crc.rs,
// fused_piece_raw_model). desc[3p] = source, desc[3p+1] = destination,
// desc[3p+2] = bytes (a multiple of KV_STRIPE, at most 64 KiB) | output
// index << 32; both addresses 16-byte aligned. Each stripe is loaded with
// coalesced 16-byte loads, stored to the destination from the same
// registers and to shared memory, from where thread t checksums bytes
// [32t, 32t+32).
#define KV_FSTEP(w) crc ^= (w); crc = kv_t[768 + (crc & 255u)] ^ kv_t[512 + ((crc >> 8) & 255u)] ^ kv_t[256 + ((crc >> 16) & 255u)] ^ kv_t[crc >> 24];
// Thread tid's accumulator after one more stripe (s, in shared memory):
// shifted past the stripe less its lane chunk, then its 32 bytes.
__device__ __forceinline__ unsigned int kv_lane_step(const unsigned int* kv_t, const unsigned int* kv_sh, unsigned int acc,
                                                     const uint4* s, unsigned int tid) {
    unsigned int crc = kv_sh[acc & 255u] ^ kv_sh[256 + ((acc >> 8) & 255u)] ^ kv_sh[512 + ((acc >> 16) & 255u)] ^ kv_sh[768 + (acc >> 24)];
    uint4 q = s[2 * tid];
    KV_FSTEP(q.x) KV_FSTEP(q.y) KV_FSTEP(q.z) KV_FSTEP(q.w)
    q = s[2 * tid + 1];
    KV_FSTEP(q.x) KV_FSTEP(q.y) KV_FSTEP(q.z) KV_FSTEP(q.w)
    return crc;
}
// The block's raw CRC into *out (thread 0 writes): every accumulator
// shifted to the end (end_shift) and xored; warp_x is 8 words of shared
// memory, free until the block's next barrier.
__device__ __forceinline__ void kv_block_reduce(unsigned int acc, unsigned int end_shift, unsigned int* warp_x,
                                                unsigned int* out) {
    unsigned int v = kv_mulmod(acc, end_shift);
    for (int o = 16; o > 0; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31u) == 0) warp_x[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int x = 0;
        for (unsigned int k = 0; k < 8; k++) x ^= warp_x[k];
        *out = x;
    }
}
extern "C" __global__ void kvferry_copy_crc(const unsigned long long* __restrict__ desc, unsigned long long n,
                                            unsigned int* __restrict__ out, const unsigned int* __restrict__ tables) {
    __shared__ unsigned int kv_t[1024];
    __shared__ unsigned int kv_sh[1024];
    __shared__ uint4 stripe[KV_STRIPE / 16];
    __shared__ unsigned int warp_x[8];
    for (unsigned int i = threadIdx.x; i < 1024u; i += blockDim.x) {
        kv_t[i] = tables[i];
        kv_sh[i] = tables[KV_STRIPE_SHIFT_AT + i];
    }
    __syncthreads();
    const unsigned int tid = threadIdx.x;
    const unsigned int end_shift = tables[KV_END_SHIFT_AT + tid];
    for (unsigned long long p = blockIdx.x; p < n; p += gridDim.x) {
        const uint4* s = (const uint4*)desc[3 * p];
        uint4* d = (uint4*)desc[3 * p + 1];
        unsigned long long w = desc[3 * p + 2], len = w & 0xffffffffull;
        unsigned int acc = 0;
        for (unsigned long long off = 0; off < len; off += KV_STRIPE) {
            const uint4* ss = s + (off >> 4);
            uint4* dd = d + (off >> 4);
            uint4 a = ss[tid], b = ss[tid + 256];
            dd[tid] = a; dd[tid + 256] = b;
            stripe[tid] = a; stripe[tid + 256] = b;
            __syncthreads();
            acc = kv_lane_step(kv_t, kv_sh, acc, stripe, tid);
            __syncthreads();
        }
        kv_block_reduce(acc, end_shift, warp_x, out + (w >> 32));
    }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// The fused kernel on sm_80 and later (kvferry_copy_crc is the one for
// older devices): cp.async keeps KV_STAGES stripes of each thread block in
// flight in a shared-memory ring, loaded without registers, while the
// block stores and checksums the oldest. On an H100 (2026-12-07) the ring
// cut a launch of 64 KiB pieces from 60.6 to 52.4 us (ncu): the loads'
// wait had been the top stall, now the CRC table lookups are. Work comes
// in *items*: descriptors items[i] .. items[i+1] (whole stripes each,
// pieces of one checksum range in order) are checksummed as one run into
// out[that index], so a scattered range pays one reduction per item, not
// one per piece. The stripe and lane mapping (and so the arithmetic) are
// kvferry_copy_crc's.
#define KV_STAGES 4
__device__ __forceinline__ void kv_cp16(uint4* smem, const uint4* gmem) {
    unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
#define KV_PRODUCE()                                                                       \
    {                                                                                      \
        if (pi < n) {                                                                      \
            const uint4* g = ps + (poff >> 4);                                             \
            uint4* r = ring + (slot_p << 9);                                               \
            kv_cp16(r + tid, g + tid);                                                     \
            kv_cp16(r + tid + 256, g + tid + 256);                                         \
            poff += KV_STRIPE;                                                             \
            if (poff >= plen) {                                                            \
                poff = 0;                                                                  \
                if (++pd == pe) {                                                          \
                    pi += gridDim.x;                                                       \
                    if (pi < n) {                                                          \
                        pd = items[pi];                                                    \
                        pe = items[pi + 1];                                                \
                    }                                                                      \
                }                                                                          \
                if (pi < n) {                                                              \
                    ps = (const uint4*)desc[3 * pd];                                       \
                    plen = desc[3 * pd + 2] & 0xffffffffull;                               \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        slot_p = slot_p + 1 == KV_STAGES ? 0 : slot_p + 1;                                 \
        asm volatile("cp.async.commit_group;\n" ::: "memory");                             \
    }
extern "C" __global__ void kvferry_copy_crc_items(const unsigned long long* __restrict__ desc,
                                                  const unsigned long long* __restrict__ items, unsigned long long n,
                                                  unsigned int* __restrict__ out, const unsigned int* __restrict__ tables) {
    __shared__ unsigned int kv_t[1024];
    __shared__ unsigned int kv_sh[1024];
    __shared__ uint4 ring[KV_STAGES * (KV_STRIPE / 16)];
    __shared__ unsigned int warp_x[8];
    for (unsigned int i = threadIdx.x; i < 1024u; i += blockDim.x) {
        kv_t[i] = tables[i];
        kv_sh[i] = tables[KV_STRIPE_SHIFT_AT + i];
    }
    __syncthreads();
    const unsigned int tid = threadIdx.x;
    const unsigned int end_shift = tables[KV_END_SHIFT_AT + tid];
    // The producer's place: item pi, its descriptor pd (items end at pe),
    // offset poff into that descriptor's plen bytes at ps.
    unsigned long long pi = blockIdx.x, pd = 0, pe = 0, poff = 0, plen = 0;
    const uint4* ps = 0;
    if (pi < n) {
        pd = items[pi];
        pe = items[pi + 1];
        ps = (const uint4*)desc[3 * pd];
        plen = desc[3 * pd + 2] & 0xffffffffull;
    }
    unsigned int slot_p = 0, slot_c = 0;
    for (int k = 0; k < KV_STAGES - 1; k++) KV_PRODUCE();
    for (unsigned long long it = blockIdx.x; it < n; it += gridDim.x) {
        const unsigned long long last = items[it + 1];
        unsigned long long w = 0;
        unsigned int acc = 0;
        for (unsigned long long q = items[it]; q < last; q++) {
            uint4* d = (uint4*)desc[3 * q + 1];
            w = desc[3 * q + 2];
            const unsigned long long len = w & 0xffffffffull;
            for (unsigned long long off = 0; off < len; off += KV_STRIPE) {
                // This stripe's group is complete once at most KV_STAGES - 2
                // newer ones are pending; the barrier makes every thread's
                // copies visible and frees the slot read last iteration.
                asm volatile("cp.async.wait_group %0;\n" ::"n"(KV_STAGES - 2) : "memory");
                __syncthreads();
                KV_PRODUCE();
                const uint4* r = ring + (slot_c << 9);
                uint4* dd = d + (off >> 4);
                dd[tid] = r[tid];
                dd[tid + 256] = r[tid + 256];
                acc = kv_lane_step(kv_t, kv_sh, acc, r, tid);
                slot_c = slot_c + 1 == KV_STAGES ? 0 : slot_c + 1;
            }
        }
        kv_block_reduce(acc, end_shift, warp_x, out + (w >> 32));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}
#endif
"#;

/// Thread blocks per SM of the fused copy-and-checksum kernel: measured on
/// the H200 (2026-12-03, 1 GiB in 32 and 64 KiB pieces), 4 beat 1, 2, 3
/// and 6, and copies of the tables per bank group gained nothing; on an
/// H100 (2026-12-07, a variant loading one stripe ahead) 2, 4, 6 and 8 were
/// within the noise of each other.
pub(crate) const FUSED_BLOCKS_PER_SM: u32 = 4;

/// Most bytes of one item of the fused kernel (a run of pieces of one
/// checksum range checksummed as one, with one reduction at its end): long
/// enough that the reduction is a few percent of the item, short enough
/// that a 64 MiB chunk gives about one item to each of the kernel's thread
/// blocks (512 items; an H100 SXM runs 132 SMs × [`FUSED_BLOCKS_PER_SM`] =
/// 528 blocks, so 16 of them stay idle for a chunk of whole items).
pub(crate) const FUSED_ITEM_BYTES: u64 = 128 << 10;

/// The kernels' source with the fused kernel's constants defined.
fn kernel_source() -> String {
    format!(
        "#define KV_STRIPE {}u\n#define KV_STRIPE_SHIFT_AT {}u\n#define KV_END_SHIFT_AT {}u\n{KERNELS}",
        crc::STRIPE_BYTES,
        crc::STRIPE_SHIFT_AT,
        crc::END_SHIFT_AT
    )
}

/// Tuning of the CUDA backend. [`CudaConfig::from_env`] reads overrides
/// (`KVFERRY_CUDA_BLOCKS_PER_SM`, `KVFERRY_CUDA_DMA_MIN_BYTES`,
/// `KVFERRY_CUDA_LAUNCH_PIECES`, `KVFERRY_CUDA_DEVICE_CHECKSUMS=0|1`,
/// `KVFERRY_CUDA_STAGING_BYTES`, `KVFERRY_CUDA_STAGING_SLOTS`,
/// `KVFERRY_CUDA_PEER_BLOCKS_PER_SM`, `KVFERRY_CUDA_PEER_FUSED=0|1`), for
/// benchmarking on a new machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// Copy-kernel thread blocks per SM (the grid is `SMs × this`, each
    /// block looping over pieces). Small enough that a save kernel and a
    /// load kernel fit on the device together.
    pub blocks_per_sm: u32,
    /// Copies of at least this many contiguous bytes go to the copy engine
    /// straight from/to the device buffer (no staging, no kernel).
    pub dma_min_bytes: u64,
    /// Zero-copy mode only: pieces per kernel launch, so a large batch
    /// starts copying while the rest of its table is being written.
    pub launch_pieces: usize,
    /// Checksum save slots on the device (otherwise the engine does it on
    /// the CPU after the copy).
    pub device_checksums: bool,
    /// Bytes of one staging slot; 0 = zero-copy mode (the kernel reads and
    /// writes the pinned pool through its mapped address). Staged copies
    /// gather fragments into a device slot (HBM speed) and move the slot's
    /// host-contiguous runs with the copy engines, so both directions run
    /// at the copy-engine peak and at once.
    pub staging_bytes: u64,
    /// Staging slots per direction (round robin; a slot is reused once the
    /// device finished with its previous chunk).
    pub staging_slots: usize,
    /// Copy-kernel thread blocks per SM for device-direct peer copies
    /// ([`ipc`]): device-to-device pieces want more blocks in flight than
    /// a PCIe-bound save or load.
    pub peer_blocks_per_sm: u32,
    /// Peer copies that are checksummed go through the fused
    /// copy-and-checksum kernel where their length is a whole number of
    /// [`crc::STRIPE_BYTES`] and both ends are 16-byte aligned (one pass
    /// over HBM instead of a copy and a second read); otherwise, and when
    /// this is off, a copy followed by the checksum kernel.
    pub peer_fused_checksums: bool,
}

impl Default for CudaConfig {
    fn default() -> Self {
        Self {
            blocks_per_sm: 4,
            dma_min_bytes: 1 << 20,
            launch_pieces: 4096,
            device_checksums: true,
            staging_bytes: 32 << 20,
            staging_slots: 4,
            peer_blocks_per_sm: 8,
            peer_fused_checksums: true,
        }
    }
}

impl CudaConfig {
    /// Defaults, overridden by the environment variables named above
    /// (unparsable values are ignored with a warning).
    pub fn from_env() -> Self {
        fn var<T: std::str::FromStr>(name: &str) -> Option<T> {
            let v = std::env::var(name).ok()?;
            let parsed = v.parse().ok();
            if parsed.is_none() {
                tracing::warn!(name, value = %v, "ignoring unparsable CUDA tuning variable");
            }
            parsed
        }
        let d = Self::default();
        Self {
            blocks_per_sm: var("KVFERRY_CUDA_BLOCKS_PER_SM").filter(|&n: &u32| n > 0).unwrap_or(d.blocks_per_sm),
            dma_min_bytes: var("KVFERRY_CUDA_DMA_MIN_BYTES").unwrap_or(d.dma_min_bytes),
            launch_pieces: var("KVFERRY_CUDA_LAUNCH_PIECES").filter(|&n: &usize| n > 0).unwrap_or(d.launch_pieces),
            device_checksums: var::<u8>("KVFERRY_CUDA_DEVICE_CHECKSUMS").map_or(d.device_checksums, |v| v != 0),
            staging_bytes: var("KVFERRY_CUDA_STAGING_BYTES").unwrap_or(d.staging_bytes),
            staging_slots: var("KVFERRY_CUDA_STAGING_SLOTS").filter(|&n: &usize| n > 0).unwrap_or(d.staging_slots),
            peer_blocks_per_sm: var("KVFERRY_CUDA_PEER_BLOCKS_PER_SM")
                .filter(|&n: &u32| n > 0)
                .unwrap_or(d.peer_blocks_per_sm),
            peer_fused_checksums: var::<u8>("KVFERRY_CUDA_PEER_FUSED").map_or(d.peer_fused_checksums, |v| v != 0),
        }
    }
}

fn unavailable(what: impl std::fmt::Display) -> GpuError {
    GpuError::Unavailable(what.to_string())
}

fn dev_err(e: impl std::fmt::Display) -> GpuError {
    GpuError::Device(e.to_string())
}

/// CUDA devices visible to this process.
///
/// # Errors
/// [`GpuError::Unavailable`] when the driver is missing or fails to init.
pub fn device_count() -> Result<usize, GpuError> {
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable("libcuda not found: no NVIDIA driver on this machine"));
    }
    let n = CudaContext::device_count().map_err(|e| unavailable(format!("cuInit/cuDeviceGetCount: {e}")))?;
    if n <= 0 {
        return Err(unavailable("no CUDA device visible"));
    }
    Ok(n as usize)
}

/// A descriptor table: `cap` u64s of pinned host memory and its mapped
/// device address.
struct Table {
    host: *mut u64,
    cap: usize,
    device: sys::CUdeviceptr,
}

#[derive(Clone, Copy)]
struct Registered {
    host: usize,
    len: usize,
    device: sys::CUdeviceptr,
}

struct Inner {
    ctx: Arc<CudaContext>,
    d2h: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    /// Saves' gather kernels into staging slots.
    gather: Arc<CudaStream>,
    /// Loads' scatter kernels out of staging slots.
    scatter: Arc<CudaStream>,
    /// The checksum kernel's stream (runs beside a save's copy).
    crc: Arc<CudaStream>,
    /// Device-direct peer copies.
    peer: Arc<CudaStream>,
    /// Peer allocations mapped through CUDA IPC, by handle.
    ipc_maps: ipc::Mappings,
    /// Staging rings in device memory, per direction.
    stage_save: Mutex<Staging>,
    stage_load: Mutex<Staging>,
    copy_kernel: CudaFunction,
    crc_kernel: CudaFunction,
    /// Peer copies with their checksums in one pass:
    /// `kvferry_copy_crc_items` on sm_80 and later, else `kvferry_copy_crc`.
    copy_crc_kernel: CudaFunction,
    /// Whether `copy_crc_kernel` takes items (runs of pieces of one
    /// checksum range, [`FUSED_ITEM_BYTES`] at most) or one piece each.
    fused_items: bool,
    /// `crc::kernel_tables()` in device memory.
    crc_tables: sys::CUdeviceptr,
    /// The device's ordinal (external memory must be this device's).
    ordinal: usize,
    /// Device buffers: the embedder's (external) and this backend's own
    /// (`owned`, freed on unregister and drop).
    buffers: BufferTable,
    /// Host memory registered with the driver (the pool).
    registered: Mutex<Vec<Registered>>,
    /// Free descriptor tables in pinned, mapped host memory, reused across
    /// batches (no device allocation or synchronous copy per batch, which
    /// would serialize concurrent batches).
    tables: Mutex<Vec<Table>>,
    sm_count: u32,
    cfg: CudaConfig,
    workers: Arc<Workers>,
}

// SAFETY: the raw device pointers are plain integers owned by this backend;
// the CUDA context, streams and function are `Send + Sync` in cudarc.
unsafe impl Send for Inner {}
// SAFETY: see above; all mutable state is behind mutexes.
unsafe impl Sync for Inner {}

/// The CUDA backend on one device.
pub struct CudaGpu {
    inner: Arc<Inner>,
}

impl CudaGpu {
    /// Opens device `ordinal`: loads the driver and NVRTC, creates a context,
    /// two streams (one per direction) and compiles the copy kernel.
    ///
    /// # Errors
    /// [`GpuError::Unavailable`] with the reason (no driver library, no such
    /// device, NVRTC missing, compile failure).
    pub fn new(ordinal: usize) -> Result<Self, GpuError> {
        Self::with_config(ordinal, CudaConfig::from_env())
    }

    /// [`CudaGpu::new`] with explicit tuning.
    ///
    /// # Errors
    /// As [`CudaGpu::new`].
    pub fn with_config(ordinal: usize, cfg: CudaConfig) -> Result<Self, GpuError> {
        // SAFETY: only probes whether the shared libraries can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(unavailable("libcuda not found: no NVIDIA driver on this machine"));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(unavailable("libnvrtc not found: the CUDA runtime compiler is needed for the copy kernel"));
        }
        let count = CudaContext::device_count().map_err(|e| unavailable(format!("cuInit/cuDeviceGetCount: {e}")))?;
        if count <= 0 || ordinal >= count as usize {
            return Err(unavailable(format!("device {ordinal} requested, {count} visible")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(format!("context on device {ordinal}: {e}")))?;
        // We order work ourselves (one stream per direction, explicit waits).
        // SAFETY: no cudarc-managed allocation exists yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = || ctx.new_stream().map_err(|e| unavailable(format!("stream: {e}")));
        let (d2h, h2d, crc_stream) = (stream()?, stream()?, stream()?);
        let (gather, scatter, peer) = (stream()?, stream()?, stream()?);
        let (cc_major, _) = ctx.compute_capability().map_err(|e| unavailable(format!("compute capability: {e}")))?;
        // cp.async (the fused kernel's ring) needs sm_80; PTX for
        // compute_80 is compiled on load for any later device.
        let opts =
            cudarc::nvrtc::CompileOptions { arch: (cc_major >= 8).then_some("compute_80"), ..Default::default() };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(kernel_source(), opts)
            .map_err(|e| unavailable(format!("nvrtc: {e:?}")))?;
        let module = ctx.load_module(ptx).map_err(|e| unavailable(format!("load module: {e}")))?;
        let load = |name: &str| module.load_function(name).map_err(|e| unavailable(format!("load {name}: {e}")));
        let (copy_kernel, crc_kernel) = (load("kvferry_copy")?, load("kvferry_crc")?);
        let fused_items = cc_major >= 8;
        let copy_crc_kernel = load(if fused_items { "kvferry_copy_crc_items" } else { "kvferry_copy_crc" })?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| unavailable(format!("attribute: {e}")))? as u32;
        let words = crc::kernel_tables();
        // SAFETY: a fresh device allocation, filled synchronously right away.
        let crc_tables = unsafe {
            let ptr = result::malloc_sync(words.len() * 4).map_err(|e| unavailable(format!("table alloc: {e}")))?;
            result::memcpy_htod_sync(ptr, &words).map_err(|e| unavailable(format!("table upload: {e}")))?;
            ptr
        };
        let staging = || -> Result<Mutex<Staging>, GpuError> {
            let n = if cfg.staging_bytes == 0 { 0 } else { cfg.staging_slots.max(1) };
            let slots = (0..n)
                .map(|_| {
                    // SAFETY: a plain device allocation, freed in `Drop`.
                    let buf = unsafe { result::malloc_sync(cfg.staging_bytes as usize) }
                        .map_err(|e| unavailable(format!("staging buffer of {} bytes: {e}", cfg.staging_bytes)))?;
                    Ok(Slot { buf, free: None })
                })
                .collect::<Result<_, GpuError>>()?;
            Ok(Mutex::new(Staging { slots, next: 0 }))
        };
        let (stage_save, stage_load) = (staging()?, staging()?);
        Ok(Self {
            inner: Arc::new(Inner {
                ctx,
                d2h,
                h2d,
                gather,
                scatter,
                crc: crc_stream,
                peer,
                ipc_maps: Mutex::default(),
                stage_save,
                stage_load,
                copy_kernel,
                crc_kernel,
                copy_crc_kernel,
                fused_items,
                crc_tables,
                ordinal,
                buffers: BufferTable::new(),
                registered: Mutex::new(Vec::new()),
                tables: Mutex::new(Vec::new()),
                sm_count,
                cfg,
                workers: Arc::default(),
            }),
        })
    }

    /// The tuning in use.
    pub fn config(&self) -> &CudaConfig {
        &self.inner.cfg
    }

    /// Device name.
    pub fn device_name(&self) -> String {
        self.inner.ctx.name().unwrap_or_else(|_| "unknown".into())
    }

    /// Raw device pointer of a buffer (benchmarks).
    pub fn device_ptr(&self, id: DeviceBufferId) -> Option<u64> {
        self.inner.buffers.get(id).map(|b| b.addr)
    }

    /// Allocates a zeroed device buffer of `bytes` that this backend owns
    /// (frees on [`Gpu::unregister`] or drop) and registers it.
    ///
    /// # Errors
    /// [`GpuError::Alloc`], or the registration's [`GpuError::Buffer`].
    pub fn alloc(&self, bytes: u64) -> Result<DeviceBufferId, GpuError> {
        let mem = DeviceMemory::alloc_in(&self.inner.ctx, bytes)?;
        let id = self.inner.buffers.register(mem.ptr, bytes, true)?;
        std::mem::forget(mem); // owned by the table now: freed by `unregister`/drop
        Ok(id)
    }

    /// Times one contiguous copy of `len` bytes between pinned host memory at
    /// `host` (inside a registered region) and device memory at `device`, on
    /// the direction's stream, with events. Returns seconds.
    ///
    /// # Errors
    /// Driver errors.
    pub fn time_raw_copy(
        &self,
        dir: Direction,
        host: *mut u8,
        device: u64,
        len: usize,
        reps: usize,
    ) -> Result<f64, GpuError> {
        let i = &self.inner;
        i.ctx.bind_to_thread().map_err(dev_err)?;
        let stream = match dir {
            Direction::DeviceToHost => &i.d2h,
            Direction::HostToDevice => &i.h2d,
        };
        self.best_event_secs(stream, reps, || {
            // SAFETY: `host..host+len` lies in registered (pinned) memory the
            // caller owns for the duration; `device..device+len` is ours.
            unsafe {
                match dir {
                    Direction::DeviceToHost => sys::cuMemcpyDtoHAsync_v2(host.cast(), device, len, stream.cu_stream()),
                    Direction::HostToDevice => sys::cuMemcpyHtoDAsync_v2(device, host.cast(), len, stream.cu_stream()),
                }
            }
            .result()
            .map_err(dev_err)
        })
    }

    /// The shortest of `reps` runs of the copies `enqueue` puts on `stream`,
    /// timed by events around them (seconds; `f64::MAX` for 0 reps). The
    /// context must be bound to this thread.
    ///
    /// # Errors
    /// Driver errors, and the first error of `enqueue`.
    fn best_event_secs(
        &self,
        stream: &CudaStream,
        reps: usize,
        mut enqueue: impl FnMut() -> Result<(), GpuError>,
    ) -> Result<f64, GpuError> {
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.inner.ctx.new_event(timing).map_err(dev_err)?;
        let end = self.inner.ctx.new_event(timing).map_err(dev_err)?;
        let mut best = f64::MAX;
        for _ in 0..reps {
            start.record(stream).map_err(dev_err)?;
            enqueue()?;
            end.record(stream).map_err(dev_err)?;
            end.synchronize().map_err(dev_err)?;
            best = best.min(f64::from(start.elapsed_ms(&end).map_err(dev_err)?) / 1e3);
        }
        Ok(best)
    }

    /// Times `len`-byte copies in both directions at once (bidirectional
    /// peak), returning seconds for the pair.
    ///
    /// # Errors
    /// Driver errors.
    pub fn time_raw_bidir(
        &self,
        host_a: *mut u8,
        host_b: *mut u8,
        dev_a: u64,
        dev_b: u64,
        len: usize,
        reps: usize,
    ) -> Result<f64, GpuError> {
        let i = &self.inner;
        i.ctx.bind_to_thread().map_err(dev_err)?;
        let mut best = f64::MAX;
        for _ in 0..reps {
            i.ctx.synchronize().map_err(dev_err)?;
            let t = std::time::Instant::now();
            // SAFETY: as in `time_raw_copy`.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(host_a.cast(), dev_a, len, i.d2h.cu_stream()).result().map_err(dev_err)?;
                sys::cuMemcpyHtoDAsync_v2(dev_b, host_b.cast(), len, i.h2d.cu_stream()).result().map_err(dev_err)?;
            }
            i.d2h.synchronize().map_err(dev_err)?;
            i.h2d.synchronize().map_err(dev_err)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    }
}

/// Writes one descriptor `(a, b, c)` at word `at` of a table.
///
/// # Safety
/// `table + at .. table + at + 3` must lie inside the table.
unsafe fn write3(table: *mut u64, at: usize, d: [u64; 3]) {
    // SAFETY: the caller guarantees the bounds.
    unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), table.add(at), 3) }
}

/// Device (UVA) address of `len` bytes of registered host memory at `host`.
fn mapped(regs: &[Registered], host: *const u8, len: u64) -> Result<u64, GpuError> {
    let h = host as usize;
    regs.iter()
        .find(|r| h >= r.host && h + len as usize <= r.host + r.len)
        .map(|r| r.device + (h - r.host) as u64)
        .ok_or_else(|| GpuError::OutOfRange(format!("host range {h:#x}+{len} is not in registered pinned memory")))
}

/// A job for a copy worker.
type Job = Box<dyn FnOnce() + Send>;

/// Threads that run batches (each blocks until the device finished its
/// batch), kept across batches: spawning one per batch delayed the first
/// copy of every batch by ~0.1 ms on the H200 host. A worker that finished
/// parks itself in `idle` with a fresh channel; a submit takes an idle
/// worker or starts a new one, so batches never queue behind each other.
#[derive(Default)]
struct Workers {
    idle: Mutex<Vec<std::sync::mpsc::Sender<Job>>>,
}

/// Idle workers kept; more exit after their batch.
const IDLE_WORKERS_MAX: usize = 16;

impl Workers {
    fn run(self: &Arc<Self>, job: Job) {
        let mut job = job;
        while let Some(tx) = self.idle.lock().expect("workers lock").pop() {
            match tx.send(job) {
                Ok(()) => return,
                Err(e) => job = e.0,
            }
        }
        let me = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("kvferry-cuda".into()).spawn(move || {
            let mut job = job;
            loop {
                job();
                let (tx, rx) = std::sync::mpsc::channel();
                let Some(w) = me.upgrade() else { return };
                {
                    let mut idle = w.idle.lock().expect("workers lock");
                    if idle.len() >= IDLE_WORKERS_MAX {
                        return;
                    }
                    idle.push(tx);
                }
                drop(w);
                // Ends when the backend (and so the idle list) is dropped.
                match rx.recv() {
                    Ok(next) => job = next,
                    Err(_) => return,
                }
            }
        });
        if let Err(e) = spawned {
            // No thread: the job (and the batch's buffers) are dropped, and
            // the completion reports the worker as gone.
            tracing::error!(error = %e, "cannot start a CUDA copy worker");
        }
    }
}

/// One staging slot: a device buffer and the event after which nothing
/// reads or writes it any more.
struct Slot {
    buf: sys::CUdeviceptr,
    free: Option<CudaEvent>,
}

/// A direction's staging ring, used round robin.
struct Staging {
    slots: Vec<Slot>,
    next: usize,
}

/// A run of host-contiguous bytes of a staged chunk.
struct Span {
    host: usize,
    stage_offset: u64,
    len: u64,
}

/// The chunk being gathered: its copy pieces start at table piece `first`.
#[derive(Default)]
struct Chunk {
    spans: Vec<Span>,
    first: usize,
    used: u64,
}

/// The state of one batch while its table is written and its work enqueued.
struct BatchRun<'a> {
    inner: &'a Inner,
    save: bool,
    table: &'a Table,
    bound: usize,
    /// Table word offsets of the copy descriptors, the checksum
    /// descriptors and the checksum outputs.
    copy_at: usize,
    crc_at: usize,
    out_at: usize,
    n_copy: usize,
    n_crc: usize,
    /// Zero-copy mode: pieces launched so far and launches made.
    launched: usize,
    parts: u32,
    /// Per checksum piece: (range, offset in range, bytes).
    folds: Vec<(u32, u64, u64)>,
    /// A direct copy-engine copy being extended: (device, host, bytes).
    direct: Option<(u64, usize, u64)>,
    /// Copy-engine calls made (direct and staged).
    dma_calls: usize,
    /// When everything was enqueued (debug timing).
    enqueued: Option<std::time::Instant>,
    chunk: Chunk,
}

impl BatchRun<'_> {
    fn dma_stream(&self) -> &CudaStream {
        if self.save { &self.inner.d2h } else { &self.inner.h2d }
    }

    fn kernel_stream(&self) -> &CudaStream {
        if self.save { &self.inner.gather } else { &self.inner.scatter }
    }

    /// Appends a copy piece; `false` when the table bound is reached.
    fn copy_piece(&mut self, d: [u64; 3]) -> bool {
        if self.n_copy >= self.bound {
            return false;
        }
        // SAFETY: `copy_at + 3 * n_copy + 2 < crc_at <= table words`.
        unsafe { write3(self.table.host, self.copy_at + 3 * self.n_copy, d) };
        self.n_copy += 1;
        true
    }

    /// Appends a checksum piece of device bytes at `dev`.
    fn crc_piece(&mut self, dev: u64, n: u64, fold: (u32, u64, u64)) -> bool {
        if self.n_crc >= self.bound {
            return false;
        }
        // SAFETY: `crc_at + 3 * n_crc + 2 < out_at <= table words`.
        unsafe { write3(self.table.host, self.crc_at + 3 * self.n_crc, [dev, self.n_crc as u64, n]) };
        self.n_crc += 1;
        self.folds.push(fold);
        true
    }

    /// Issues (or extends) a copy-engine copy of `len` bytes.
    fn direct(&mut self, dev: u64, host: usize, len: u64) -> Result<(), GpuError> {
        if let Some((d, h, n)) = &mut self.direct
            && *d + *n == dev
            && *h + *n as usize == host
        {
            *n += len;
            return Ok(());
        }
        self.flush_direct()?;
        self.direct = Some((dev, host, len));
        Ok(())
    }

    fn flush_direct(&mut self) -> Result<(), GpuError> {
        let Some((dev, host, len)) = self.direct.take() else { return Ok(()) };
        self.dma_calls += 1;
        let stream = self.dma_stream().cu_stream();
        // SAFETY: both ranges were validated (device buffer, registered host
        // memory) and outlive the batch.
        unsafe {
            if self.save {
                sys::cuMemcpyDtoHAsync_v2(host as *mut _, dev, len as usize, stream)
            } else {
                sys::cuMemcpyHtoDAsync_v2(dev, host as *const _, len as usize, stream)
            }
        }
        .result()
        .map_err(dev_err)
    }

    /// Launches the zero-copy pieces written since the last launch once
    /// there are `at_least` of them (ramping up so the device starts early).
    fn launch_zero_copy(&mut self, at_least: usize) -> Result<(), GpuError> {
        let part = at_least.min(self.inner.cfg.launch_pieces.min(256 << self.parts.min(8)));
        if self.n_copy - self.launched >= part.max(1) {
            let desc = self.table.device + 8 * (self.copy_at + 3 * self.launched) as u64;
            self.inner.launch_copy(self.dma_stream(), desc, self.n_copy - self.launched, 0, 0)?;
            self.launched = self.n_copy;
            self.parts += 1;
        }
        Ok(())
    }

    /// Enqueues the staged chunk: save = gather kernel into a slot, then
    /// copy-engine copies slot → host; load = copies host → slot, then the
    /// scatter kernel. The slot's previous user is waited for on the device.
    fn flush_chunk(&mut self) -> Result<(), GpuError> {
        if self.chunk.spans.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::take(&mut self.chunk);
        self.chunk.first = self.n_copy;
        let i = self.inner;
        let desc = self.table.device + 8 * (self.copy_at + 3 * chunk.first) as u64;
        let pieces = self.n_copy - chunk.first;
        let (dma, kernel) = (self.dma_stream(), self.kernel_stream());
        let mut staging = if self.save { &i.stage_save } else { &i.stage_load }.lock().expect("staging lock");
        let (n, next) = (staging.slots.len(), staging.next);
        let slot = &mut staging.slots[next % n];
        let buf = slot.buf;
        if self.save {
            if let Some(e) = &slot.free {
                kernel.wait(e).map_err(dev_err)?;
            }
            i.launch_copy(kernel, desc, pieces, 0, buf)?;
            dma.wait(&kernel.record_event(None).map_err(dev_err)?).map_err(dev_err)?;
            for s in &chunk.spans {
                // SAFETY: `buf + stage_offset + len <= staging bytes` and the
                // host span lies in registered memory the batch owns.
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(s.host as *mut _, buf + s.stage_offset, s.len as usize, dma.cu_stream())
                }
                .result()
                .map_err(dev_err)?;
            }
            slot.free = Some(dma.record_event(None).map_err(dev_err)?);
        } else {
            if let Some(e) = &slot.free {
                dma.wait(e).map_err(dev_err)?;
            }
            for s in &chunk.spans {
                // SAFETY: as above, in the other direction.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(buf + s.stage_offset, s.host as *const _, s.len as usize, dma.cu_stream())
                }
                .result()
                .map_err(dev_err)?;
            }
            kernel.wait(&dma.record_event(None).map_err(dev_err)?).map_err(dev_err)?;
            i.launch_copy(kernel, desc, pieces, buf, 0)?;
            slot.free = Some(kernel.record_event(None).map_err(dev_err)?);
        }
        staging.next = (staging.next + 1) % n;
        self.parts += 1;
        self.dma_calls += chunk.spans.len();
        Ok(())
    }

    /// Adds the copy of one validated op: `dev`, `host` (CPU address) and
    /// `mapped` (the host bytes' device address) of `op`.
    fn add(&mut self, op: &super::CopyOp, dev: u64, host: usize, mapped: u64) -> Result<(), GpuError> {
        let cfg = &self.inner.cfg;
        let staged = cfg.staging_bytes > 0;
        if op.len >= cfg.dma_min_bytes || (staged && op.len > cfg.staging_bytes) {
            return self.direct(dev, host, op.len);
        }
        self.flush_direct()?;
        if staged {
            if self.chunk.used + op.len > cfg.staging_bytes {
                self.flush_chunk()?;
            }
            let stage_offset = self.chunk.used;
            match self.chunk.spans.last_mut() {
                Some(s) if s.host + s.len as usize == host => s.len += op.len,
                _ => self.chunk.spans.push(Span { host, stage_offset, len: op.len }),
            }
            self.chunk.used += op.len;
        }
        // Staged: device ↔ slot offset; zero-copy: device ↔ mapped host.
        let other = if staged { self.chunk.used - op.len } else { mapped };
        let mut off = 0;
        while off < op.len {
            let n = (op.len - off).min(PIECE_BYTES_MAX);
            let d = if self.save { [dev + off, other + off, n] } else { [other + off, dev + off, n] };
            if !self.copy_piece(d) {
                return Err(GpuError::Device("descriptor table bound exceeded".into()));
            }
            off += n;
        }
        if !staged {
            self.launch_zero_copy(usize::MAX)?;
        }
        Ok(())
    }

    /// Adds the checksum pieces of one op of a save (its device bytes at
    /// `dev`), cut at checksum range boundaries.
    fn add_checksums(&mut self, index: &RangeIndex, op: &super::CopyOp, dev: u64) -> Result<(), GpuError> {
        let mut ok = true;
        crc::checksum_pieces(index, op.extent, op.host_offset, op.len, |r, in_range, off, n| {
            ok &= self.crc_piece(dev + off, n, (r, in_range, n));
        });
        if ok { Ok(()) } else { Err(GpuError::Device("descriptor table bound exceeded".into())) }
    }

    /// Enqueues the copies still pending (the last direct copy, the last
    /// chunk or zero-copy pieces).
    fn flush(&mut self) -> Result<(), GpuError> {
        self.flush_direct()?;
        if self.inner.cfg.staging_bytes > 0 { self.flush_chunk() } else { self.launch_zero_copy(1) }
    }

    /// Launches the checksum kernel over the checksum pieces and records
    /// the batch's completion events: `(copies done, checksums done)`.
    fn record(&mut self) -> Result<(Vec<CudaEvent>, Option<CudaEvent>), GpuError> {
        let i = self.inner;
        let mut summed = None;
        if self.n_crc > 0 {
            let desc = self.table.device + 8 * self.crc_at as u64;
            let out = self.table.device + 8 * self.out_at as u64;
            i.launch(&i.crc, &i.crc_kernel, desc, self.n_crc, &[out, i.crc_tables], i.cfg.blocks_per_sm)?;
            summed = Some(i.crc.record_event(None).map_err(dev_err)?);
        }
        self.enqueued = Some(std::time::Instant::now());
        let copied = vec![
            self.dma_stream().record_event(None).map_err(dev_err)?,
            self.kernel_stream().record_event(None).map_err(dev_err)?,
        ];
        Ok((copied, summed))
    }

    /// Folds the checksum kernel's piece CRCs (once it finished) into the
    /// ranges' CRCs; `None` when a range was not tiled.
    fn fold(&self, checksums: &[super::ChecksumRange]) -> Option<Vec<u32>> {
        // SAFETY: the checksum kernel finished writing `n_crc` u32s at `out_at`.
        let out = unsafe { std::slice::from_raw_parts(self.table.host.add(self.out_at).cast::<u32>(), self.n_crc) };
        let mut folder = RangeFolder::new(checksums);
        for (&(r, off, n), &raw) in self.folds.iter().zip(out) {
            folder.add(r, off, n, raw);
        }
        folder.finish()
    }
}

impl Inner {
    /// Runs one batch (validated against `bufs`, the buffer table it was
    /// submitted with) to completion; returns the checksums of its ranges
    /// when they were computed on the device.
    fn run(&self, batch: &CopyBatch, bufs: &BatchPin) -> Result<Option<Vec<u32>>, GpuError> {
        let started = std::time::Instant::now();
        let save = batch.direction == Direction::DeviceToHost;
        let index = (save && self.cfg.device_checksums && !batch.checksums.is_empty())
            .then(|| RangeIndex::new(&batch.checksums, batch.host.len()))
            .flatten();
        let checksumming = index.is_some();
        // Pieces: each ends at the piece size, a range boundary or its op's end.
        let boundaries = if checksumming { 2 * batch.checksums.len() } else { 0 };
        let bound = batch.ops.iter().map(|o| o.len.div_ceil(PIECE_BYTES_MAX) as usize).sum::<usize>() + boundaries;
        if bound == 0 {
            return Ok(None);
        }
        let regs: Vec<Registered> = self.registered.lock().expect("registered lock").clone();
        let words = if checksumming { 6 * bound + bound.div_ceil(2) } else { 3 * bound };
        self.ctx.bind_to_thread().map_err(dev_err)?;
        let table = self.take_table(words)?;
        let mut run = BatchRun {
            inner: self,
            save,
            table: &table,
            bound,
            copy_at: 0,
            crc_at: 3 * bound,
            out_at: 6 * bound,
            n_copy: 0,
            n_crc: 0,
            launched: 0,
            parts: 0,
            folds: Vec::new(),
            direct: None,
            dma_calls: 0,
            enqueued: None,
            chunk: Chunk::default(),
        };
        let dev =
            |op: &super::CopyOp| bufs.get(op.buffer).expect("validated against this snapshot").0 + op.device_offset;
        let res: Result<Option<Vec<u32>>, GpuError> = (|| {
            for op in &batch.ops {
                let host_ptr = match &batch.host[op.extent] {
                    HostBuf::Writable(e) => e.as_ptr(),
                    HostBuf::Sealed(e) => e.as_ptr(),
                };
                // SAFETY: validate_batch checked `host_offset + len <= extent len`.
                let host = unsafe { host_ptr.add(op.host_offset as usize) };
                let mapped = mapped(&regs, host, op.len)?;
                run.add(op, dev(op), host as usize, mapped)?;
            }
            // Copies first, so the device starts before the checksum pieces
            // are written; the checksum kernel then runs beside the copies.
            run.flush()?;
            if let Some(index) = &index {
                for op in &batch.ops {
                    run.add_checksums(index, op, dev(op))?;
                }
            }
            let (copied, summed) = run.record()?;
            // The checksums are ready long before the copies: fold meanwhile.
            let sums = match summed {
                Some(e) => {
                    e.synchronize().map_err(dev_err)?;
                    run.fold(&batch.checksums)
                }
                None => None,
            };
            copied.iter().try_for_each(|e| e.synchronize().map_err(dev_err))?;
            Ok(sums)
        })();
        let built = started.elapsed();
        if res.is_err() {
            // Do not reuse a table or slot a failed batch might still touch.
            let _ = self.ctx.synchronize();
        }
        let (n_copy, n_crc, parts, dma_calls) = (run.n_copy, run.n_crc, run.parts, run.dma_calls);
        let enqueued = run.enqueued.map(|t| t - started).unwrap_or_default();
        drop(run);
        self.put_table(table);
        let sums = res?;
        tracing::debug!(
            direction = ?batch.direction,
            ops = batch.ops.len(),
            copy_pieces = n_copy,
            crc_pieces = n_crc,
            parts,
            dma_calls,
            enqueued_us = enqueued.as_micros() as u64,
            completed_us = built.as_micros() as u64,
            "cuda batch"
        );
        Ok(sums)
    }

    /// Launches the copy kernel over `n` descriptors at `desc` on `stream`;
    /// `src_base`/`dst_base` are added to every descriptor's source and
    /// destination (a staging slot's address, or 0).
    fn launch_copy(
        &self,
        stream: &CudaStream,
        desc: u64,
        n: usize,
        src_base: u64,
        dst_base: u64,
    ) -> Result<(), GpuError> {
        self.launch(stream, &self.copy_kernel, desc, n, &[src_base, dst_base], self.cfg.blocks_per_sm)
    }

    /// Launches `kernel(desc, n, extra…)` over `n` descriptors on `stream`,
    /// with a grid of up to `per_sm` thread blocks per SM.
    fn launch(
        &self,
        stream: &CudaStream,
        kernel: &CudaFunction,
        desc: u64,
        n: usize,
        extra: &[u64],
        per_sm: u32,
    ) -> Result<(), GpuError> {
        if n == 0 {
            return Ok(());
        }
        let n = n as u64;
        let grid = n.min(u64::from(self.sm_count * per_sm)).max(1) as u32;
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(kernel);
        b.arg(&desc);
        b.arg(&n);
        for x in extra {
            b.arg(x);
        }
        // SAFETY: every descriptor was validated against its buffer and a
        // registered host region or a staging slot; the kernels touch only
        // those ranges (and the checksum kernel its output array and tables).
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err)
    }

    /// Launches `kvferry_copy_crc_items(desc, items, n, out, tables)` over
    /// `n` items on `stream` ([`FUSED_BLOCKS_PER_SM`] thread blocks per SM
    /// at most).
    fn launch_items(&self, stream: &CudaStream, desc: u64, items: u64, n: usize, out: u64) -> Result<(), GpuError> {
        let n = n as u64;
        let grid = n.min(u64::from(self.sm_count * FUSED_BLOCKS_PER_SM)).max(1) as u32;
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&self.copy_crc_kernel);
        b.arg(&desc).arg(&items).arg(&n).arg(&out).arg(&self.crc_tables);
        // SAFETY: every descriptor was validated against its peer buffer and
        // a destination of ours; items index those descriptors and end at
        // the sentinel written before the launch.
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err)
    }

    /// Device address of `[offset, offset+len)` in buffer `id`, range
    /// checked, with the context bound to this thread.
    fn checked_ptr(&self, id: DeviceBufferId, offset: u64, len: u64) -> Result<sys::CUdeviceptr, GpuError> {
        let b = self.buffers.get(id).ok_or(GpuError::UnknownBuffer(id))?;
        super::checked_range(offset, len, b.len)?;
        self.ctx.bind_to_thread().map_err(dev_err)?;
        Ok(b.addr + offset)
    }

    fn take_table(&self, n: usize) -> Result<Table, GpuError> {
        let mut free = self.tables.lock().expect("tables lock");
        if let Some(i) = free.iter().position(|t| t.cap >= n) {
            return Ok(free.swap_remove(i));
        }
        drop(free);
        let cap = n.next_power_of_two().max(3 * 1024);
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh pinned allocation of `cap` u64s.
        let host = unsafe { result::malloc_host(cap * 8, flags) }.map_err(dev_err)? as *mut u64;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) }.result().map_err(dev_err)?;
        Ok(Table { host, cap, device })
    }

    fn put_table(&self, t: Table) {
        self.tables.lock().expect("tables lock").push(t);
    }
}

impl Gpu for CudaGpu {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn time_raw_device_copy(&self, bytes: u64, reps: usize) -> Result<Option<f64>, GpuError> {
        let (src, dst) = (self.alloc(bytes)?, self.alloc(bytes)?);
        let timed = (|| -> Result<f64, GpuError> {
            let i = &self.inner;
            let addr = |id| i.buffers.get(id).map(|b| b.addr).ok_or(GpuError::UnknownBuffer(id));
            let (s, d) = (addr(src)?, addr(dst)?);
            i.ctx.bind_to_thread().map_err(dev_err)?;
            self.best_event_secs(&i.peer, reps.max(1), || {
                // SAFETY: two live allocations of `bytes` each, made above.
                unsafe { sys::cuMemcpyDtoDAsync_v2(d, s, bytes as usize, i.peer.cu_stream()) }.result().map_err(dev_err)
            })
        })();
        let (a, b) = (self.unregister(src), self.unregister(dst));
        let secs = timed?;
        a?;
        b?;
        Ok(Some(secs))
    }

    fn time_raw_host_to_device_copy(&self, bytes: u64, reps: usize) -> Result<Option<f64>, GpuError> {
        let len = usize::try_from(bytes).map_err(|_| GpuError::OutOfRange(format!("{bytes} bytes")))?;
        let dst = self.alloc(bytes)?;
        // Written, so every page is present before it is pinned.
        let mut host = vec![1u8; len];
        let timed = (|| -> Result<f64, GpuError> {
            let addr = self.inner.buffers.get(dst).map(|b| b.addr).ok_or(GpuError::UnknownBuffer(dst))?;
            self.inner.ctx.bind_to_thread().map_err(dev_err)?;
            // SAFETY: `host` is a live allocation of `len` bytes, unpinned
            // below before it drops.
            unsafe { sys::cuMemHostRegister_v2(host.as_mut_ptr().cast(), len, 0) }.result().map_err(dev_err)?;
            let secs = self.time_raw_copy(Direction::HostToDevice, host.as_mut_ptr(), addr, len, reps.max(1));
            // SAFETY: registered just above; no copy is in flight (the
            // timing waited for its events).
            let _ = unsafe { sys::cuMemHostUnregister(host.as_mut_ptr().cast()) };
            secs
        })();
        let freed = self.unregister(dst);
        let secs = timed?;
        freed?;
        Ok(Some(secs))
    }

    unsafe fn register_external(&self, addr: u64, len: u64) -> Result<DeviceBufferId, GpuError> {
        // The table's own range checks first, so a null or odd pointer is
        // never handed to the driver; the overlap check comes with the insert.
        crate::memory::buffers::check_range(addr, len)?;
        self.inner.check_external(addr, len)?;
        Ok(self.inner.buffers.register(addr, len, false)?)
    }

    fn unregister(&self, id: DeviceBufferId) -> Result<(), GpuError> {
        let entry = self.inner.buffers.unregister(id)?;
        peer::revoke_process(&self.inner.buffers, id);
        if entry.owned {
            drop(DeviceMemory { ctx: self.inner.ctx.clone(), ptr: entry.addr, len: entry.len });
        }
        Ok(())
    }

    fn buffer_len(&self, id: DeviceBufferId) -> Option<u64> {
        self.inner.buffers.get(id).map(|b| b.len)
    }

    fn allocation_range(&self, addr: u64) -> Result<Option<(u64, u64)>, GpuError> {
        let (memory_type, _, start, size) = self.inner.pointer_attributes(addr)?;
        // An address the driver does not know (plain host memory, freed)
        // has no allocation it can bound.
        if memory_type == 0 || size == 0 || start > addr || addr - start >= size {
            return Ok(None);
        }
        Ok(Some((start, size)))
    }

    fn alloc_kv_memory(&self, bytes: u64) -> Result<Box<dyn KvMemory>, GpuError> {
        Ok(Box::new(DeviceMemory::alloc_in(&self.inner.ctx, bytes)?))
    }

    fn register_host(&self, base: *mut u8, len: u64) -> Result<(), GpuError> {
        let i = &self.inner;
        i.ctx.bind_to_thread().map_err(dev_err)?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: `base..base+len` is memory the caller owns for the
        // backend's lifetime (the pool arena); registering pins it.
        unsafe { sys::cuMemHostRegister_v2(base.cast(), len as usize, flags) }
            .result()
            .map_err(|e| unavailable(format!("cuMemHostRegister of {len} bytes: {e}")))?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `base` was just registered with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, base.cast(), 0) }
            .result()
            .map_err(|e| unavailable(format!("cuMemHostGetDevicePointer: {e}")))?;
        i.registered.lock().expect("registered lock").push(Registered {
            host: base as usize,
            len: len as usize,
            device: dptr,
        });
        Ok(())
    }

    fn submit(&self, batch: CopyBatch) -> Completion {
        // One pinned snapshot of the buffer table serves validation and the
        // run; the pin keeps every buffer the batch touches registered until
        // the worker is done with it (C15).
        let bufs = match pin_and_validate(&self.inner.buffers, &batch) {
            Ok(pin) => pin,
            Err(e) => {
                return Box::pin(std::future::ready(Completed { host: batch.host, result: Err(e), checksums: None }));
            }
        };
        let inner = self.inner.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        // The worker owns the batch (and so the host buffers) until the GPU
        // finished with them, whatever happens to the completion future.
        let submitted = std::time::Instant::now();
        let workers = inner.workers.clone();
        workers.run(Box::new(move || {
            tracing::trace!(spawn_us = submitted.elapsed().as_micros() as u64, "cuda worker up");
            let (result, checksums) = match inner.run(&batch, &bufs) {
                Ok(sums) => (Ok(()), sums),
                Err(e) => (Err(e), None),
            };
            let _ = tx.send(Completed { host: batch.host, result, checksums });
            drop(bufs);
        }));
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| Completed {
                host: Vec::new(),
                result: Err(GpuError::Device("copy worker died".into())),
                checksums: None,
            })
        })
    }

    fn checksums_on_device(&self) -> bool {
        self.inner.cfg.device_checksums
    }

    fn write(&self, id: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), GpuError> {
        let ptr = self.inner.checked_ptr(id, offset, data.len() as u64)?;
        // SAFETY: `checked_ptr` bounds the range inside the buffer.
        unsafe { result::memcpy_htod_sync(ptr, data) }.map_err(dev_err)
    }

    fn read(&self, id: DeviceBufferId, offset: u64, out: &mut [u8]) -> Result<(), GpuError> {
        let ptr = self.inner.checked_ptr(id, offset, out.len() as u64)?;
        // SAFETY: `checked_ptr` bounds the range inside the buffer.
        unsafe { result::memcpy_dtoh_sync(out, ptr) }.map_err(dev_err)
    }

    fn peer_kind(&self) -> Option<PeerKind> {
        Some(PeerKind::CudaIpc)
    }

    fn export_buffer(&self, id: DeviceBufferId, kind: PeerKind) -> Result<peer::BufferExport, GpuError> {
        self.inner.export(id, kind)
    }

    fn open_peer_buffer(&self, export: &peer::BufferExport) -> Result<Arc<dyn peer::PeerBuffer>, GpuError> {
        self.inner.open(export)
    }

    fn open_host_region(
        &self,
        addr: usize,
        len: u64,
        keep: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<Arc<dyn peer::PeerBuffer>, GpuError> {
        self.inner.open_host_region(addr, len, keep)
    }

    fn submit_peer(&self, batch: peer::PeerCopyBatch) -> peer::PeerCompletion {
        let called = std::time::Instant::now();
        let ready = |r| -> peer::PeerCompletion { Box::pin(std::future::ready(r)) };
        if let Err(e) = peer::validate_peer_batch(&batch) {
            return ready(Err(e));
        }
        let src = match self.inner.resolve_sources(&batch) {
            Ok(s) => s,
            Err(e) => return ready(Err(e)),
        };
        // Destinations stay registered until the worker is done (C15).
        let dst = self.inner.buffers.pin_batch(batch.ops.iter().map(|op| op.dst));
        let inner = self.inner.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let submitted = std::time::Instant::now();
        // The worker owns the batch, its sources and the pins until the
        // device finished, whatever happens to the completion (C11).
        inner.workers.clone().run(Box::new(move || {
            let r = inner.run_peer(&batch, &src, &dst, (called, submitted));
            let _ = tx.send(r);
            drop((src, dst, batch));
        }));
        Box::pin(async move { rx.await.unwrap_or_else(|_| Err(GpuError::Device("copy worker died".into()))) })
    }
}

impl Inner {
    /// Checks with the driver's pointer attributes that `[addr, addr+len)`
    /// is device memory of this device inside one allocation (the context
    /// is the device's primary one, shared with the CUDA runtime: memory
    /// PyTorch or CuPy allocated in this process qualifies).
    fn check_external(&self, addr: u64, len: u64) -> Result<(), GpuError> {
        let (memory_type, ordinal, start, size) = self.pointer_attributes(addr)?;
        if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            let memory_type = match memory_type {
                0 => "unknown to the driver: host memory, or freed".to_string(),
                t if t == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => "pinned host memory".to_string(),
                t => format!("memory type {t}"),
            };
            return Err(ExternalMemoryError::NotDeviceMemory { addr, memory_type }.into());
        }
        if ordinal < 0 || ordinal as usize != self.ordinal {
            return Err(ExternalMemoryError::OtherDevice {
                addr,
                device: i64::from(ordinal),
                backend_device: self.ordinal,
            }
            .into());
        }
        if start > addr || addr + len > start + size {
            return Err(ExternalMemoryError::OutsideAllocation {
                addr,
                len,
                allocation_start: start,
                allocation_len: size,
            }
            .into());
        }
        Ok(())
    }

    /// The driver's `(memory type, device ordinal, allocation start,
    /// allocation length)` for `addr`; `(0, -1, 0, 0)` for an address the
    /// driver does not know.
    fn pointer_attributes(&self, addr: u64) -> Result<(u32, i32, u64, u64), GpuError> {
        use sys::CUpointer_attribute as A;
        self.ctx.bind_to_thread().map_err(dev_err)?;
        let mut memory_type: u32 = 0;
        let mut ordinal: i32 = -1;
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        let mut attrs = [
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut data: [*mut std::ffi::c_void; 4] = [
            (&mut memory_type as *mut u32).cast(),
            (&mut ordinal as *mut i32).cast(),
            (&mut start as *mut sys::CUdeviceptr).cast(),
            (&mut size as *mut usize).cast(),
        ];
        // SAFETY: four attributes, four pointers to locals of the sizes the
        // driver writes (u32 memory type, int ordinal, CUdeviceptr, size_t).
        // The plural call leaves the defaults for a pointer it does not know.
        unsafe { sys::cuPointerGetAttributes(4, attrs.as_mut_ptr(), data.as_mut_ptr(), addr) }
            .result()
            .map_err(|e| ExternalMemoryError::Query { addr, reason: e.to_string() })?;
        Ok((memory_type, ordinal, start, size as u64))
    }
}

/// Device memory allocated with the driver API (`cuMemAlloc`) in a device's
/// primary context, outside any backend's table: what an embedder's
/// allocator would hand kvferry. Freed on drop; keep it alive until its
/// buffer is unregistered.
pub struct DeviceMemory {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: u64,
}

// SAFETY: a device address and a context handle (`Send + Sync` in cudarc).
unsafe impl Send for DeviceMemory {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    /// `bytes` of zeroed memory on device `ordinal` (its primary context).
    ///
    /// # Errors
    /// [`GpuError::Unavailable`] without a driver or device,
    /// [`GpuError::Alloc`].
    pub fn alloc(ordinal: usize, bytes: u64) -> Result<Self, GpuError> {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(unavailable("libcuda not found: no NVIDIA driver on this machine"));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(format!("context on device {ordinal}: {e}")))?;
        Self::alloc_in(&ctx, bytes)
    }

    fn alloc_in(ctx: &Arc<CudaContext>, bytes: u64) -> Result<Self, GpuError> {
        ctx.bind_to_thread().map_err(dev_err)?;
        let len = usize::try_from(bytes).map_err(|_| GpuError::Alloc { bytes, reason: "too large".into() })?;
        // SAFETY: a plain device allocation of `len` bytes, zeroed next.
        let ptr =
            unsafe { result::malloc_sync(len.max(1)) }.map_err(|e| GpuError::Alloc { bytes, reason: e.to_string() })?;
        let mem = Self { ctx: ctx.clone(), ptr, len: bytes };
        // SAFETY: `ptr` is a fresh allocation of at least `len` bytes.
        unsafe { result::memset_d8_sync(ptr, 0, len) }.map_err(|e| GpuError::Alloc { bytes, reason: e.to_string() })?;
        Ok(mem)
    }
}

impl KvMemory for DeviceMemory {
    fn addr(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `alloc_in`, freed once; the owner promised no
        // backend uses it any more (its buffer was unregistered).
        unsafe {
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// The external-memory checks `kvferry bench gpu` runs on a real device
/// (C15): a sub-range inside a larger allocation (a framework tensor that is
/// a slice of its allocator's segment) registers; a host pointer, a range
/// that overruns its allocation and — where a second device exists — another
/// device's memory are typed errors that register nothing. Returns one line
/// per check, saying what was refused and why.
///
/// # Errors
/// The first check that went the wrong way, as text.
pub fn external_memory_checks(gpu: &CudaGpu, device: usize) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let live = gpu.inner.buffers.live();
    let seg = DeviceMemory::alloc(device, 1 << 20).map_err(|e| e.to_string())?;
    // A slice in the middle of the allocation registers and unregisters.
    // SAFETY: `seg` outlives the registration.
    let id =
        unsafe { gpu.register_external(seg.addr() + 4096, 64 << 10) }.map_err(|e| format!("slice refused: {e}"))?;
    gpu.unregister(id).map_err(|e| e.to_string())?;
    out.push("a 64 KiB slice inside a 1 MiB allocation: registered".to_string());
    let host = vec![0u128; 4096];
    let mut expect = |what: &str, addr: u64, len: u64, ok: fn(&GpuError) -> bool| -> Result<(), String> {
        // SAFETY: nothing is registered (each case must be refused).
        match unsafe { gpu.register_external(addr, len) } {
            Err(e) if ok(&e) => {
                out.push(format!("{what}: refused ({e})"));
                Ok(())
            }
            Err(e) => Err(format!("{what}: refused for the wrong reason: {e}")),
            Ok(id) => {
                let _ = gpu.unregister(id);
                Err(format!("{what}: registered"))
            }
        }
    };
    expect("a host pointer", host.as_ptr() as u64, 4096, |e| {
        matches!(e, GpuError::External(ExternalMemoryError::NotDeviceMemory { .. }))
    })?;
    // The allocation as the driver sizes it (it may round the request up).
    let (_, _, start, size) = gpu.inner.pointer_attributes(seg.addr()).map_err(|e| e.to_string())?;
    expect("a range overrunning its allocation by 1 byte", seg.addr(), start + size - seg.addr() + 1, |e| {
        matches!(e, GpuError::External(ExternalMemoryError::OutsideAllocation { .. }))
    })?;
    let count = device_count().unwrap_or(1);
    if count > 1 {
        let other = DeviceMemory::alloc((device + 1) % count, 1 << 20).map_err(|e| e.to_string())?;
        expect("memory of another device", other.addr(), 4096, |e| {
            matches!(e, GpuError::External(ExternalMemoryError::OtherDevice { .. }))
        })?;
    } else {
        out.push("memory of another device: not checked (one device visible)".to_string());
    }
    if gpu.inner.buffers.live() != live {
        return Err("a refused registration left a buffer behind".into());
    }
    Ok(out)
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        for b in self.buffers.drain() {
            if b.owned {
                // SAFETY: allocated by `alloc`, freed once, device idle.
                unsafe {
                    let _ = result::free_sync(b.addr);
                }
            }
        }
        // SAFETY: allocated in `with_config`, device idle.
        unsafe {
            let _ = result::free_sync(self.crc_tables);
        }
        for stage in [&self.stage_save, &self.stage_load] {
            for slot in stage.lock().expect("staging lock").slots.drain(..) {
                drop(slot.free);
                // SAFETY: allocated in `with_config`, device idle.
                unsafe {
                    let _ = result::free_sync(slot.buf);
                }
            }
        }
        for t in self.tables.lock().expect("tables lock").drain(..) {
            // SAFETY: allocated by `take_table`, device idle.
            unsafe {
                let _ = result::free_host(t.host.cast());
            }
        }
        for r in self.registered.lock().expect("registered lock").drain(..) {
            // SAFETY: registered by `register_host`, device idle.
            unsafe {
                let _ = sys::cuMemHostUnregister(r.host as *mut std::ffi::c_void);
            }
        }
    }
}
