//! How to cut the host backend's copy work into parts for
//! [`crate::rt::map_parts`] (OS threads on real builds, one part after the
//! other under the simulator: the same chunked code runs everywhere). No
//! runtime-specific code lives here.

/// How many parts to cut `bytes` of copy work into: at least
/// [`crate::limits::HOST_COPY_BYTES_PER_THREAD_MIN`] bytes each, at most
/// [`crate::limits::HOST_COPY_THREADS_MAX`] and the runtime's
/// [`crate::rt::cpu_parallelism`]. Never 0.
pub fn parts_for(bytes: u64) -> usize {
    let by_size = (bytes / crate::limits::HOST_COPY_BYTES_PER_THREAD_MIN).max(1);
    let by_size = usize::try_from(by_size).unwrap_or(usize::MAX);
    by_size.min(crate::limits::HOST_COPY_THREADS_MAX).min(crate::rt::cpu_parallelism()).max(1)
}

#[cfg(test)]
mod tests {
    use super::parts_for;
    use crate::limits::{HOST_COPY_BYTES_PER_THREAD_MIN, HOST_COPY_THREADS_MAX};
    use crate::rt::map_parts;

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
