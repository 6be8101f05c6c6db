//! Spreading CPU-bound copy work over OS threads where the runtime allows
//! it, and running it on the calling thread where it does not.
//!
//! [`crate::rt::cpu_parallelism`] is the machine's parallelism on real tokio
//! and 1 under the simulator (which must not start OS threads: a seed has
//! to replay identically, and madsim panics on foreign threads). So the
//! same chunked code runs everywhere: on several scoped threads outside the
//! simulator, one part after the other inside it. No runtime-specific code
//! lives here.

/// How many parts to cut `bytes` of copy work into: at least
/// [`crate::limits::HOST_COPY_BYTES_PER_THREAD_MIN`] bytes each, at most
/// [`crate::limits::HOST_COPY_THREADS_MAX`] and the runtime's
/// [`crate::rt::cpu_parallelism`]; 1 under the simulator. Never 0.
pub fn parts_for(bytes: u64) -> usize {
    let by_size = (bytes / crate::limits::HOST_COPY_BYTES_PER_THREAD_MIN).max(1);
    let by_size = usize::try_from(by_size).unwrap_or(usize::MAX);
    by_size.min(crate::limits::HOST_COPY_THREADS_MAX).min(crate::rt::cpu_parallelism()).max(1)
}

/// Runs `f` on every part and returns the results in the parts' order.
/// With more than one part and [`crate::rt::cpu_parallelism`] above 1, the
/// parts after the first run on scoped OS threads while the calling thread
/// runs the first (so a batch of `n` parts starts `n - 1` threads);
/// otherwise every part runs on the calling thread, one after the other.
///
/// # Panics
/// Re-raises a panic of `f` on any part.
pub fn map_parts<T: Send, R: Send>(parts: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    if parts.len() <= 1 || crate::rt::cpu_parallelism() <= 1 {
        return parts.into_iter().map(f).collect();
    }
    let f = &f;
    std::thread::scope(|s| {
        let mut parts = parts.into_iter();
        let first = parts.next();
        let handles: Vec<_> = parts.map(|p| s.spawn(move || f(p))).collect();
        let mut out = Vec::with_capacity(handles.len() + 1);
        out.extend(first.map(f));
        for h in handles {
            match h.join() {
                Ok(r) => out.push(r),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::{map_parts, parts_for};
    use crate::limits::{HOST_COPY_BYTES_PER_THREAD_MIN, HOST_COPY_THREADS_MAX};

    #[test]
    fn results_come_back_in_the_parts_order() {
        let parts: Vec<u64> = (0..13).collect();
        assert_eq!(map_parts(parts, |x| x * x), (0..13).map(|x| x * x).collect::<Vec<_>>());
        assert_eq!(map_parts(Vec::<u64>::new(), |x| x), Vec::<u64>::new());
    }

    #[test]
    fn small_work_is_one_part_and_large_work_is_bounded() {
        assert_eq!(parts_for(0), 1);
        assert_eq!(parts_for(HOST_COPY_BYTES_PER_THREAD_MIN - 1), 1);
        let n = parts_for(u64::MAX);
        assert!((1..=HOST_COPY_THREADS_MAX).contains(&n), "{n}");
        assert!(n <= crate::rt::cpu_parallelism());
    }
}
