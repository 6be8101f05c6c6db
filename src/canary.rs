//! Canaries: deliberately broken variants of the starred contracts, one per
//! contract, behind one seam (design.md §4, "Canaries").
//!
//! A checker that never fails proves nothing. Each [`Canary`] names one
//! contract and one breakage of it; the simulator's `broken_<contract>_is_caught`
//! tests switch one on ([`activate`]), sweep at most 50 seeds and pass only
//! if the invariant named for that contract fires.
//!
//! Production code reaches every breakage through [`active`] and nothing
//! else. Without the `canaries` cargo feature [`active`] is a `const fn`
//! returning `false`, so the compiler removes every breakage and a release
//! build carries none of them. With the feature, the active set is
//! per thread: madsim runs a whole simulation on the test's thread, so
//! concurrent canary tests in one process do not see each other's canary.
//! (Outside the simulator the feature is meaningless: a real runtime's
//! worker threads never see the test thread's set.)

/// One deliberate breakage, named by the contract it violates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Canary {
    /// C1: a flush acknowledges before its batch is sent.
    C1FlushAcksEarly,
    /// C2: a flush overruns its bound (sleeps past twice its deadline, or
    /// past twice the plain-flush bound, before returning).
    C2FlushUnbounded,
    /// C4: an eviction forgets to offer (and to count) the removal of the
    /// last block it evicts.
    C4RemovalLost,
    /// C6: the backfill after a MetaServer restart re-advertises nothing
    /// (while reporting success).
    C6NoBackfill,
    /// C8: a transfer lock pins every found block but the last one.
    C8PinsTooFew,
    /// C8: a fetch forgets its transfer lock on the error and cancel paths
    /// (the hook sits in `engine::fetch`'s driver).
    C8ReleaseForgotten,
    /// C8: a fetch that read some of its parts from an owner and then
    /// stopped on a transport error skips that owner's
    /// `ReleaseTransferLock` (the hook sits in the fetch machine); the lock
    /// is left to expire.
    C8ReleaseSkippedAfterPartialRead,
    /// C8: a fetch handed a transfer ticket it does not read from (another
    /// reader's, blocks it holds already, a fetch cancelled before it
    /// started) drops it without releasing its session (the hook sits in
    /// `engine::fetch`'s ticket hold); the lock is left to expire.
    C8TicketUnreleased,
    /// C9: a transport read ignores its deadline (waits up to 5 s more).
    C9ReadPastDeadline,
    /// C9: the fetch deadline is 1000x the configured one (the hook sits in
    /// `engine::fetch`), so a fetch from a stalled owner waits for it.
    C9FetchDeadlineStretched,
    /// C9: `Engine::connect_peer` keeps trying a peer that is down or
    /// unreachable 5 s past its timeout (the hook sits in `engine::fetch`).
    C9ConnectPastTimeout,
    /// C10: the fetcher takes the owner's advertised checksums for what it
    /// read instead of computing them (the hook sits in `engine::fetch`'s
    /// driver), so a corrupted payload is accepted.
    C10WeakChecksum,
    /// C11: eviction ignores holders (leased, locked, in-flight blocks are
    /// freed and their memory reused).
    C11EvictHeld,
    /// C13: the owner authorizes data-plane reads under a transfer session
    /// whose lock expired but was not yet collected by the GC.
    C13ServeExpiredSession,
    /// C15: the engine unregisters a device buffer a layout still names.
    C15UnregisterInUse,
    /// C15: the buffer table answers `Ok` to an unregister while in-flight
    /// copy batches still touch the buffer (it ignores "busy").
    C15UnregisterWhileBusy,
    /// C16: the engine's transfer-session ids stop advancing and carry no
    /// secret, so a released id is granted again.
    C16SessionIdsRepeat,
    /// C17: the disk tier hands out the bytes of a record it read without
    /// verifying its identity or slot checksums (the hook sits in
    /// `disk::tier`'s read completion).
    C17DiskReadUnverified,
    /// C18: recovery of the disk tier keeps every record whose header
    /// decodes, without checking its slot checksums (the hook sits in
    /// `disk::tier`'s recovery).
    C18RecoverUnverified,
    /// C19: the owner hands out device leases past their deadline until
    /// its GC collects them (the lease table's take skips expiry), with the
    /// full time left of a fresh lease, so a reader copies an owner's
    /// device blocks after the lease ended.
    C19LeaseExpiryIgnored,
}

impl Canary {
    /// Every canary, in contract order.
    pub const ALL: [Canary; 20] = [
        Canary::C1FlushAcksEarly,
        Canary::C2FlushUnbounded,
        Canary::C4RemovalLost,
        Canary::C6NoBackfill,
        Canary::C8PinsTooFew,
        Canary::C8ReleaseForgotten,
        Canary::C8ReleaseSkippedAfterPartialRead,
        Canary::C8TicketUnreleased,
        Canary::C9ReadPastDeadline,
        Canary::C9FetchDeadlineStretched,
        Canary::C9ConnectPastTimeout,
        Canary::C10WeakChecksum,
        Canary::C11EvictHeld,
        Canary::C13ServeExpiredSession,
        Canary::C15UnregisterInUse,
        Canary::C15UnregisterWhileBusy,
        Canary::C16SessionIdsRepeat,
        Canary::C17DiskReadUnverified,
        Canary::C18RecoverUnverified,
        Canary::C19LeaseExpiryIgnored,
    ];

    /// The contract this canary violates (`"C1"`, `"C8"`, ...).
    pub fn contract(self) -> &'static str {
        match self {
            Canary::C1FlushAcksEarly => "C1",
            Canary::C2FlushUnbounded => "C2",
            Canary::C4RemovalLost => "C4",
            Canary::C6NoBackfill => "C6",
            Canary::C8PinsTooFew
            | Canary::C8ReleaseForgotten
            | Canary::C8ReleaseSkippedAfterPartialRead
            | Canary::C8TicketUnreleased => "C8",
            Canary::C9ReadPastDeadline | Canary::C9FetchDeadlineStretched | Canary::C9ConnectPastTimeout => "C9",
            Canary::C10WeakChecksum => "C10",
            Canary::C11EvictHeld => "C11",
            Canary::C13ServeExpiredSession => "C13",
            Canary::C15UnregisterInUse | Canary::C15UnregisterWhileBusy => "C15",
            Canary::C16SessionIdsRepeat => "C16",
            Canary::C17DiskReadUnverified => "C17",
            Canary::C18RecoverUnverified => "C18",
            Canary::C19LeaseExpiryIgnored => "C19",
        }
    }

    #[cfg(any(feature = "canaries", test))]
    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

#[cfg(feature = "canaries")]
thread_local! {
    static ACTIVE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether `c` is switched on for this thread. Always `false` (a constant)
/// without the `canaries` feature.
#[cfg(not(feature = "canaries"))]
#[inline(always)]
pub const fn active(c: Canary) -> bool {
    let _ = c;
    false
}

/// Whether `c` is switched on for this thread. Always `false` (a constant)
/// without the `canaries` feature.
#[cfg(feature = "canaries")]
#[inline]
pub fn active(c: Canary) -> bool {
    ACTIVE.with(|a| a.get() & c.bit() != 0)
}

/// Switches `c` on (or every canary off, with `None`) for this thread.
/// Without the `canaries` feature this does nothing.
pub fn activate(c: Option<Canary>) {
    #[cfg(feature = "canaries")]
    ACTIVE.with(|a| a.set(c.map_or(0, Canary::bit)));
    #[cfg(not(feature = "canaries"))]
    let _ = c;
}

/// Whether this build can activate canaries (the `canaries` feature).
pub const ENABLED: bool = cfg!(feature = "canaries");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_are_distinct() {
        let mut seen = 0u32;
        for c in Canary::ALL {
            assert_eq!(seen & c.bit(), 0, "{c:?} shares a bit");
            seen |= c.bit();
        }
    }

    #[test]
    fn only_the_activated_canary_is_active() {
        activate(Some(Canary::C10WeakChecksum));
        for c in Canary::ALL {
            assert_eq!(active(c), ENABLED && c == Canary::C10WeakChecksum, "{c:?}");
        }
        activate(None);
        assert!(Canary::ALL.iter().all(|&c| !active(c)));
    }
}
