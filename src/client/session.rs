//! The client's session lifecycle as a pure state machine (no runtime, no
//! I/O, no clock of its own): the heartbeat schedule and its backoff,
//! fencing (a refused heartbeat, a fenced write), the backfill owed after
//! the MetaServer lost this node's session (C5, C6) and close. It lives
//! beside the registration queue in the client's core, under the same
//! lock, and follows the queue's split: the caller feeds what happened
//! ([`Event`]) with the time it happened (`now`, a [`Duration`] since an
//! origin the caller picks, never going back), and performs what comes
//! out ([`Action`]). The async driver in the client's `mod.rs` only sends
//! the RPCs, sleeps and reports; every decision is made here, which lets a
//! property test (`tests` below) drive the real machine through any order
//! of answers, refusals, fenced writes, failed backfills and closes.
//!
//! The driver's loop, one *turn* at a time: [`Event::Turn`] (a scheduled
//! heartbeat if due; else a backfill if owed), the heartbeat's answer
//! ([`Event::Heartbeat`], then a backfill if owed), the backfill's failure
//! if any ([`Event::BackfillFailed`]), one batch of the queue (not the
//! machine's business), and when the queue has nothing, [`Event::Idle`]
//! (sleep until the next scheduled heartbeat, or a wake-up). A write the
//! MetaServer fenced is [`Event::ChunkFenced`], which may ask for an
//! *inline* heartbeat before the write is retried.
//!
//! Guarantees, each asserted by the property test:
//! - **schedule**: scheduled heartbeats go at `now` after an accepted one
//!   plus `max(stale_after / 2, interval_min)` (C5); after one that got no
//!   answer or was refused, plus the backoff, which starts at
//!   `backoff_min`, doubles per failure up to `backoff_max` and resets on
//!   an accepted heartbeat; inline heartbeats never move the schedule;
//! - **confirmation jumps the schedule**: after a fenced write, a fenced
//!   backfill or a refused heartbeat the session needs confirming; until a
//!   heartbeat is accepted every turn heartbeats at once, unless
//!   heartbeats are being refused: then the backoff alone decides, and a
//!   fenced write sends no inline heartbeat either (a refused client does
//!   not hammer the MetaServer);
//! - **refusal is not terminal**: a refused session is not registered
//!   and keeps heartbeating on the backoff schedule; the next accepted
//!   heartbeat takes over (C5);
//! - **backfill** (C6): an accepted heartbeat that reports a new session
//!   owes a backfill when this client had been accepted before (the
//!   MetaServer restarted or expired us) or registrations were already lost
//!   before the first contact (a restarted node fenced until its old
//!   session went stale). The owed backfill goes at the first turn whose
//!   session is confirmed, never while a confirmation is pending; a failed
//!   backfill is owed again; nothing else starts one;
//! - **close**: the first [`Event::Close`] fails what is pending and stops
//!   the driver; after it the machine sends nothing (no heartbeat, no
//!   backfill) and every turn ends in [`Action::Stop`].

use std::time::Duration;

/// The machine's timing policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionPolicy {
    /// First backoff after a heartbeat that failed or was refused.
    pub backoff_min: Duration,
    /// The backoff's cap.
    pub backoff_max: Duration,
    /// Floor of the interval between accepted heartbeats.
    pub interval_min: Duration,
}

impl Default for SessionPolicy {
    /// From [`crate::limits`]: backoff 100 ms doubling to 5 s, interval at
    /// least 100 ms.
    fn default() -> Self {
        Self {
            backoff_min: Duration::from_millis(crate::limits::HEARTBEAT_BACKOFF_MS_MIN),
            backoff_max: Duration::from_millis(crate::limits::HEARTBEAT_BACKOFF_MS_MAX),
            interval_min: Duration::from_millis(100),
        }
    }
}

/// Which heartbeat an answer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Beat {
    /// The driver's, on the schedule (or jumping it): its answer moves the
    /// schedule and may start an owed backfill.
    Scheduled,
    /// Sent by a fenced write before its retry: its answer changes the
    /// session's standing only, never the schedule.
    Inline,
}

/// The MetaServer's answer to a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Accepted: this client's session is the node's session.
    Accepted {
        /// The MetaServer did not know this session before (first
        /// contact, or it restarted or expired us).
        new_session: bool,
        /// The MetaServer's staleness bound (heartbeats go at half of it).
        stale_after: Duration,
        /// The queue has dropped registrations so far (only looked at on a
        /// client's first accepted heartbeat).
        registrations_lost: bool,
    },
    /// Refused (`FAILED_PRECONDITION`): another live session holds this
    /// node's address.
    Refused,
    /// No answer: a transport error, a deadline, the server down. Says
    /// nothing about the session.
    NoAnswer,
}

/// What happened, fed to [`SessionMachine::on`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The driver starts a turn.
    Turn,
    /// A heartbeat the machine asked for was answered (or not).
    Heartbeat {
        /// Which heartbeat.
        beat: Beat,
        /// Its answer.
        answer: Answer,
    },
    /// A registration RPC was refused with `FAILED_PRECONDITION`: the
    /// MetaServer lost or fenced this session.
    ChunkFenced,
    /// A backfill the machine asked for stopped at a failed RPC (a backfill
    /// that completes needs no event).
    BackfillFailed {
        /// The failure was `FAILED_PRECONDITION` (the session is fenced).
        fenced: bool,
    },
    /// The queue has nothing to send: the driver is about to wait.
    Idle,
    /// The client shuts down or aborts.
    Close,
}

/// Something worth a log line; the driver adds the details it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// The MetaServer lost this node's session: a backfill is owed.
    SessionLost,
    /// The first refusal after an accepted or unanswered heartbeat.
    Refused,
}

/// What the driver must do, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Send a heartbeat, then feed its answer as [`Event::Heartbeat`] with
    /// this beat.
    SendHeartbeat(Beat),
    /// Re-advertise every resident block; feed [`Event::BackfillFailed`]
    /// if an RPC of it fails.
    Backfill,
    /// Wait until this time (or a wake-up), then start a turn.
    Sleep {
        /// The next scheduled heartbeat.
        until: Duration,
    },
    /// Drop every queued registration and resolve every waiting flush.
    FailPending,
    /// Stop the driver.
    Stop,
    /// Log this.
    Notice(Notice),
}

/// What the MetaServer said about this session at the last heartbeat that
/// got an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// No heartbeat answered yet.
    Unknown,
    /// Accepted: registrations go through.
    Accepted,
    /// Refused: another live session holds the address; writes are fenced.
    Refused,
}

/// The session lifecycle (see the module doc).
#[derive(Debug, Clone)]
pub struct SessionMachine {
    policy: SessionPolicy,
    standing: Standing,
    /// Some heartbeat was ever accepted.
    ever_accepted: bool,
    /// A write was fenced or a heartbeat refused: heartbeat (and be
    /// accepted) before the next backfill.
    confirm: bool,
    /// A backfill is owed.
    backfill_due: bool,
    /// When the next scheduled heartbeat is due.
    next_heartbeat: Duration,
    /// The wait after the next failed scheduled heartbeat.
    backoff: Duration,
    closed: bool,
}

impl SessionMachine {
    /// A new session, its first heartbeat due at time zero.
    pub fn new(policy: SessionPolicy) -> Self {
        Self {
            policy,
            standing: Standing::Unknown,
            ever_accepted: false,
            confirm: false,
            backfill_due: false,
            next_heartbeat: Duration::ZERO,
            backoff: policy.backoff_min,
            closed: false,
        }
    }

    /// Feeds one event that happened at `now`; returns the actions to
    /// perform, in order.
    pub fn on(&mut self, ev: Event, now: Duration) -> Vec<Action> {
        let mut out = Vec::new();
        match ev {
            Event::Turn if self.closed => out.push(Action::Stop),
            Event::Turn => {
                // Confirmation jumps the schedule, except after a refusal:
                // then the backoff alone decides.
                let jump = self.confirm && self.standing != Standing::Refused;
                if now >= self.next_heartbeat || jump {
                    out.push(Action::SendHeartbeat(Beat::Scheduled));
                } else {
                    self.backfill_if_owed(&mut out);
                }
            }
            Event::Heartbeat { beat, answer } => {
                self.on_answer(beat, answer, now, &mut out);
                if beat == Beat::Scheduled {
                    self.backfill_if_owed(&mut out);
                }
            }
            Event::ChunkFenced => {
                let inline = self.standing != Standing::Refused;
                self.confirm = true;
                if inline && !self.closed {
                    out.push(Action::SendHeartbeat(Beat::Inline));
                }
            }
            Event::BackfillFailed { fenced } => {
                self.confirm |= fenced;
                self.backfill_due = true;
            }
            Event::Idle if self.closed => out.push(Action::Stop),
            Event::Idle => out.push(Action::Sleep { until: self.next_heartbeat }),
            Event::Close if self.closed => {}
            Event::Close => {
                self.closed = true;
                out.extend([Action::FailPending, Action::Stop]);
            }
        }
        out
    }

    fn on_answer(&mut self, beat: Beat, answer: Answer, now: Duration, out: &mut Vec<Action>) {
        match answer {
            Answer::Accepted { new_session, stale_after, registrations_lost } => {
                self.confirm = false;
                self.standing = Standing::Accepted;
                let was = std::mem::replace(&mut self.ever_accepted, true);
                // On first contact a backfill is owed only if registrations
                // were already lost (e.g. a restarted node fenced until its
                // old session went stale); without this, such blocks stayed
                // invisible even across later MetaServer restarts (C6,
                // found by the simulator).
                if new_session && (was || registrations_lost) {
                    self.backfill_due = true;
                    if !self.closed {
                        out.push(Action::Notice(Notice::SessionLost));
                    }
                }
                if beat == Beat::Scheduled {
                    self.backoff = self.policy.backoff_min;
                    self.next_heartbeat = now + (stale_after / 2).max(self.policy.interval_min);
                }
            }
            Answer::Refused => {
                // Not registered any more: writes would be fenced, so
                // heartbeat again on the backoff schedule until the other
                // session goes stale and ours takes over.
                self.confirm = true;
                if self.standing != Standing::Refused && !self.closed {
                    out.push(Action::Notice(Notice::Refused));
                }
                self.standing = Standing::Refused;
                self.back_off(beat, now);
            }
            Answer::NoAnswer => self.back_off(beat, now),
        }
    }

    fn back_off(&mut self, beat: Beat, now: Duration) {
        if beat == Beat::Scheduled {
            self.next_heartbeat = now + self.backoff;
            self.backoff = (self.backoff * 2).min(self.policy.backoff_max);
        }
    }

    fn backfill_if_owed(&mut self, out: &mut Vec<Action>) {
        if self.backfill_due && !self.confirm && !self.closed {
            self.backfill_due = false;
            out.push(Action::Backfill);
        }
    }

    /// The MetaServer's word on this session at the last answered heartbeat.
    pub fn standing(&self) -> Standing {
        self.standing
    }

    /// Whether the last answered heartbeat was accepted.
    pub fn is_registered(&self) -> bool {
        self.standing == Standing::Accepted
    }

    /// Whether [`Event::Close`] was fed.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Whether a backfill is owed and not yet asked for.
    pub fn backfill_owed(&self) -> bool {
        self.backfill_due
    }

    /// When the next scheduled heartbeat is due.
    pub fn next_heartbeat(&self) -> Duration {
        self.next_heartbeat
    }
}

#[cfg(test)]
mod tests {
    //! Unit tests for each transition, then the real machine driven the way
    //! the client's driver drives it (a turn performs its heartbeat and its
    //! backfill before anything else; a fenced write performs its inline
    //! heartbeat) through a world whose every answer, fenced write, clock
    //! step and close is drawn from a byte script, checked against the
    //! guarantees of the module doc restated as a model.
    use proptest::prelude::*;

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn ms(n: u64) -> Duration {
        MS * n as u32
    }

    fn policy() -> SessionPolicy {
        SessionPolicy::default()
    }

    fn accepted(new_session: bool, lost: bool) -> Answer {
        Answer::Accepted { new_session, stale_after: Duration::from_secs(10), registrations_lost: lost }
    }

    fn hb(beat: Beat, answer: Answer) -> Event {
        Event::Heartbeat { beat, answer }
    }

    const SCHEDULED: Action = Action::SendHeartbeat(Beat::Scheduled);
    const INLINE: Action = Action::SendHeartbeat(Beat::Inline);

    /// A machine whose first heartbeat at 0 was accepted (a new session on
    /// first contact, nothing lost): next heartbeat at 5 s.
    fn registered() -> SessionMachine {
        let mut m = SessionMachine::new(policy());
        assert_eq!(m.on(Event::Turn, ms(0)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, accepted(true, false)), ms(0)), []);
        assert!(m.is_registered());
        m
    }

    #[test]
    fn the_first_turn_heartbeats_at_once_and_nothing_is_registered_before_an_answer() {
        let mut m = SessionMachine::new(policy());
        assert_eq!(m.standing(), Standing::Unknown);
        assert!(!m.is_registered());
        assert_eq!(m.on(Event::Idle, ms(0)), [Action::Sleep { until: ms(0) }]);
        assert_eq!(m.on(Event::Turn, ms(0)), [SCHEDULED]);
    }

    #[test]
    fn an_accepted_heartbeat_schedules_the_next_at_half_stale_after_floored() {
        let mut m = registered();
        assert_eq!(m.next_heartbeat(), ms(5_000));
        assert_eq!(m.on(Event::Turn, ms(4_999)), []);
        assert_eq!(m.on(Event::Idle, ms(4_999)), [Action::Sleep { until: ms(5_000) }]);
        assert_eq!(m.on(Event::Turn, ms(5_000)), [SCHEDULED]);
        let short = Answer::Accepted { new_session: false, stale_after: ms(10), registrations_lost: false };
        assert_eq!(m.on(hb(Beat::Scheduled, short), ms(5_003)), []);
        assert_eq!(m.next_heartbeat(), ms(5_103), "interval_min floors stale_after / 2");
    }

    #[test]
    fn failed_heartbeats_back_off_doubling_to_the_cap_and_an_accepted_one_resets_it() {
        let mut m = SessionMachine::new(policy());
        let mut t = 0;
        let mut gaps = Vec::new();
        for _ in 0..9 {
            assert_eq!(m.on(Event::Turn, ms(t)), [SCHEDULED]);
            assert_eq!(m.on(hb(Beat::Scheduled, Answer::NoAnswer), ms(t)), []);
            let next = m.next_heartbeat().as_millis() as u64;
            gaps.push(next - t);
            t = next;
        }
        assert_eq!(gaps, [100, 200, 400, 800, 1_600, 3_200, 5_000, 5_000, 5_000]);
        assert_eq!(m.standing(), Standing::Unknown, "no answer says nothing about the session");
        assert_eq!(m.on(Event::Turn, ms(t)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, accepted(true, false)), ms(t)), []);
        assert_eq!(m.on(Event::Turn, ms(t + 5_000)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, Answer::NoAnswer), ms(t + 5_000)), []);
        assert_eq!(m.next_heartbeat(), ms(t + 5_100), "the backoff starts over");
        assert!(m.is_registered(), "no answer keeps the last standing");
    }

    #[test]
    fn a_fenced_write_heartbeats_inline_and_jumps_the_schedule_without_moving_it() {
        let mut m = registered();
        assert_eq!(m.on(Event::ChunkFenced, ms(10)), [INLINE]);
        // The inline heartbeat got no answer: the schedule is untouched and
        // the next turn heartbeats at once.
        assert_eq!(m.on(hb(Beat::Inline, Answer::NoAnswer), ms(20)), []);
        assert_eq!(m.next_heartbeat(), ms(5_000));
        assert_eq!(m.on(Event::Turn, ms(30)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, accepted(false, false)), ms(40)), []);
        assert_eq!(m.next_heartbeat(), ms(5_040));
        // An accepted inline heartbeat confirms the session: no jump.
        assert_eq!(m.on(Event::ChunkFenced, ms(50)), [INLINE]);
        assert_eq!(m.on(hb(Beat::Inline, accepted(false, false)), ms(60)), []);
        assert_eq!(m.next_heartbeat(), ms(5_040));
        assert_eq!(m.on(Event::Turn, ms(70)), []);
    }

    #[test]
    fn a_refused_session_heartbeats_on_the_backoff_alone_until_it_takes_over() {
        let mut m = registered();
        assert_eq!(m.on(Event::Turn, ms(5_000)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, Answer::Refused), ms(5_000)), [Action::Notice(Notice::Refused)]);
        assert_eq!(m.standing(), Standing::Refused);
        assert!(!m.is_registered());
        // No inline heartbeat per fenced write, no jump of the schedule.
        assert_eq!(m.on(Event::ChunkFenced, ms(5_010)), []);
        assert_eq!(m.on(Event::Turn, ms(5_020)), []);
        assert_eq!(m.on(Event::Turn, ms(5_100)), [SCHEDULED]);
        // Refused again: no second notice; the backoff doubles.
        assert_eq!(m.on(hb(Beat::Scheduled, Answer::Refused), ms(5_100)), []);
        assert_eq!(m.next_heartbeat(), ms(5_300));
        assert_eq!(m.on(Event::Turn, ms(5_300)), [SCHEDULED]);
        // The other session went stale: ours takes over as a new session and
        // the blocks it had advertised are owed a backfill.
        assert_eq!(
            m.on(hb(Beat::Scheduled, accepted(true, false)), ms(5_300)),
            [Action::Notice(Notice::SessionLost), Action::Backfill]
        );
        assert!(m.is_registered());
    }

    #[test]
    fn first_contact_owes_a_backfill_only_when_registrations_were_lost() {
        let mut m = SessionMachine::new(policy());
        assert_eq!(m.on(Event::Turn, ms(0)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, accepted(true, false)), ms(0)), []);
        let mut m = SessionMachine::new(policy());
        assert_eq!(m.on(Event::Turn, ms(0)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, Answer::Refused), ms(0)), [Action::Notice(Notice::Refused)]);
        assert_eq!(m.on(Event::Turn, ms(100)), [SCHEDULED]);
        assert_eq!(
            m.on(hb(Beat::Scheduled, accepted(true, true)), ms(100)),
            [Action::Notice(Notice::SessionLost), Action::Backfill]
        );
        // Later, lost registrations alone owe nothing: only a lost session.
        assert_eq!(m.on(Event::Turn, ms(5_100)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, accepted(false, true)), ms(5_100)), []);
    }

    #[test]
    fn a_lost_session_is_backfilled_once_confirmed_and_again_after_a_failure() {
        let mut m = registered();
        // The MetaServer restarted: an inline heartbeat learns it.
        assert_eq!(m.on(Event::ChunkFenced, ms(10)), [INLINE]);
        assert_eq!(m.on(hb(Beat::Inline, accepted(true, false)), ms(10)), [Action::Notice(Notice::SessionLost)]);
        assert!(m.backfill_owed());
        // The next turn backfills (the session is confirmed).
        assert_eq!(m.on(Event::Turn, ms(20)), [Action::Backfill]);
        assert!(!m.backfill_owed());
        // The backfill failed: owed again, and again at the next turn.
        assert_eq!(m.on(Event::BackfillFailed { fenced: false }, ms(30)), []);
        assert_eq!(m.on(Event::Turn, ms(40)), [Action::Backfill]);
        // Fenced this time: heartbeat first, backfill after its acceptance.
        assert_eq!(m.on(Event::BackfillFailed { fenced: true }, ms(50)), []);
        assert_eq!(m.on(Event::Turn, ms(60)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, Answer::NoAnswer), ms(60)), [], "not while unconfirmed");
        // Unconfirmed (not refused): every turn heartbeats, backoff or not.
        assert_eq!(m.on(Event::Turn, ms(70)), [SCHEDULED]);
        assert_eq!(m.on(hb(Beat::Scheduled, accepted(false, false)), ms(70)), [Action::Backfill]);
        assert_eq!(m.on(Event::Turn, ms(80)), []);
    }

    #[test]
    fn close_fails_pending_and_stops_once_and_nothing_is_sent_after() {
        let mut m = registered();
        assert_eq!(m.on(Event::ChunkFenced, ms(1)), [INLINE]);
        assert_eq!(m.on(Event::Close, ms(2)), [Action::FailPending, Action::Stop]);
        assert!(m.is_closed());
        assert_eq!(m.on(Event::Close, ms(3)), []);
        // The inline heartbeat in flight comes back with a lost session:
        // nothing is sent for it.
        assert_eq!(m.on(hb(Beat::Inline, accepted(true, false)), ms(4)), []);
        assert_eq!(m.on(hb(Beat::Scheduled, accepted(true, false)), ms(4)), []);
        assert_eq!(m.on(Event::ChunkFenced, ms(5)), []);
        assert_eq!(m.on(Event::Turn, ms(6_000)), [Action::Stop]);
        assert_eq!(m.on(Event::Idle, ms(6_000)), [Action::Stop]);
    }

    // ------------------------------------------------------------ the property

    /// Draws from the script; once it runs out every draw is 0.
    struct Script<'a>(&'a [u8], usize);

    impl Script<'_> {
        fn next(&mut self) -> u8 {
            let b = self.0.get(self.1).copied().unwrap_or(0);
            self.1 += 1;
            b
        }
        fn done(&self) -> bool {
            self.1 >= self.0.len()
        }
        /// True with probability about `pct` %.
        fn chance(&mut self, pct: u32) -> bool {
            u32::from(self.next()) * 100 < pct * 256
        }
        fn answer(&mut self) -> Answer {
            match self.next() % 8 {
                0 | 1 => Answer::NoAnswer,
                2 => Answer::Refused,
                k => Answer::Accepted {
                    new_session: k >= 6,
                    stale_after: ms(u64::from(self.next()) * 40),
                    registrations_lost: self.chance(30),
                },
            }
        }
    }

    /// The guarantees of the module doc, as the test's own bookkeeping.
    struct Model {
        p: SessionPolicy,
        now: Duration,
        next_due: Duration,
        backoff: Duration,
        /// Last answered heartbeat (None: none yet).
        last: Option<Answer>,
        ever_accepted: bool,
        /// A fenced write, refusal or fenced backfill since the last accepted heartbeat.
        unconfirmed: bool,
        owed: bool,
        closed: bool,
    }

    impl Model {
        fn refused(&self) -> bool {
            self.last == Some(Answer::Refused)
        }
        /// What a turn with no heartbeat, or a scheduled heartbeat's answer,
        /// must end with.
        fn backfill_now(&mut self) -> Vec<Action> {
            if self.owed && !self.unconfirmed && !self.closed {
                self.owed = false;
                vec![Action::Backfill]
            } else {
                Vec::new()
            }
        }
        fn answer(&mut self, beat: Beat, a: Answer) -> Vec<Action> {
            let mut want = Vec::new();
            match a {
                Answer::Accepted { new_session, stale_after, registrations_lost } => {
                    if new_session && (self.ever_accepted || registrations_lost) {
                        self.owed = true;
                        if !self.closed {
                            want.push(Action::Notice(Notice::SessionLost));
                        }
                    }
                    self.ever_accepted = true;
                    self.unconfirmed = false;
                    if beat == Beat::Scheduled {
                        let gap = (stale_after / 2).max(self.p.interval_min);
                        assert!(gap >= self.p.interval_min);
                        self.next_due = self.now + gap;
                        self.backoff = self.p.backoff_min;
                    }
                }
                Answer::Refused | Answer::NoAnswer => {
                    if a == Answer::Refused {
                        if !self.refused() && !self.closed {
                            want.push(Action::Notice(Notice::Refused));
                        }
                        self.unconfirmed = true;
                    }
                    if beat == Beat::Scheduled {
                        assert!(self.p.backoff_min <= self.backoff && self.backoff <= self.p.backoff_max);
                        self.next_due = self.now + self.backoff;
                        self.backoff = (self.backoff * 2).min(self.p.backoff_max);
                    }
                }
            }
            if a != Answer::NoAnswer {
                self.last = Some(a);
            }
            if beat == Beat::Scheduled {
                want.extend(self.backfill_now());
            }
            want
        }
    }

    /// Which paths a walk took (to show the walks reach them all).
    #[derive(Default, Debug)]
    struct Paths {
        backfills: usize,
        backfills_after_a_failure: usize,
        refusals_taken_over: usize,
        fenced_while_refused: usize,
        inline_heartbeats: usize,
        capped_backoffs: usize,
        closed_with_an_answer_after: usize,
    }

    /// Drives the machine from `script` the way the client's driver does,
    /// asserting every output against the model.
    fn walk(script: &[u8]) -> Paths {
        let mut s = Script(script, 0);
        let p = policy();
        let mut m = SessionMachine::new(p);
        let mut w = Model {
            p,
            now: Duration::ZERO,
            next_due: Duration::ZERO,
            backoff: p.backoff_min,
            last: None,
            ever_accepted: false,
            unconfirmed: false,
            owed: false,
            closed: false,
        };
        let mut paths = Paths::default();
        let mut failed_backfill = false;
        let mut heal = false;
        for step in 0.. {
            if s.done() && !heal {
                // Heal: every answer accepted from here; an owed backfill
                // must go within a few turns.
                heal = true;
            }
            if heal && step > script.len() + 8 {
                break;
            }
            // Healing alternates a step past any heartbeat due and a turn.
            let kind = if heal { if step % 2 == 0 { 0 } else { 4 } } else { s.next() % 16 };
            match kind {
                // The clock moves on (sometimes past the next heartbeat).
                0..=3 if heal => w.now += ms(6_000),
                0..=3 => w.now += ms(u64::from(s.next()) * 25),
                // A turn, performed as the driver does.
                4..=8 => {
                    let out = m.on(Event::Turn, w.now);
                    if w.closed {
                        assert_eq!(out, [Action::Stop]);
                        continue;
                    }
                    let jump = w.unconfirmed && !w.refused();
                    if w.now >= w.next_due || jump {
                        assert_eq!(out, [SCHEDULED], "turn at {:?}, due {:?}", w.now, w.next_due);
                        let a = if heal { accepted(false, false) } else { s.answer() };
                        if w.refused() && matches!(a, Answer::Accepted { .. }) {
                            paths.refusals_taken_over += 1;
                        }
                        if a != accepted(false, false) && w.backoff == p.backoff_max {
                            paths.capped_backoffs += 1;
                        }
                        let want = w.answer(Beat::Scheduled, a);
                        let out = m.on(hb(Beat::Scheduled, a), w.now);
                        assert_eq!(out, want, "answer {a:?}");
                        perform_backfill(&mut m, &mut w, &mut s, &out, heal, &mut failed_backfill, &mut paths);
                    } else {
                        let want = w.backfill_now();
                        assert_eq!(out, want, "turn without a heartbeat");
                        perform_backfill(&mut m, &mut w, &mut s, &out, heal, &mut failed_backfill, &mut paths);
                    }
                }
                // A registration RPC was fenced.
                9..=11 => {
                    let out = m.on(Event::ChunkFenced, w.now);
                    let inline = !w.refused() && !w.closed;
                    paths.fenced_while_refused += usize::from(w.refused());
                    w.unconfirmed = true;
                    if inline {
                        assert_eq!(out, [INLINE]);
                        paths.inline_heartbeats += 1;
                        let a = s.answer();
                        let due = w.next_due;
                        let want = w.answer(Beat::Inline, a);
                        assert_eq!(m.on(hb(Beat::Inline, a), w.now), want);
                        assert_eq!(m.next_heartbeat(), due, "an inline heartbeat moved the schedule");
                    } else {
                        assert_eq!(out, [], "inline heartbeat while refused or closed");
                    }
                }
                // The queue ran dry.
                12..=14 => {
                    let out = m.on(Event::Idle, w.now);
                    if w.closed {
                        assert_eq!(out, [Action::Stop]);
                    } else {
                        assert_eq!(out, [Action::Sleep { until: w.next_due }]);
                    }
                }
                // Close (rarely), and a late answer of a heartbeat in flight.
                _ => {
                    if !s.chance(15) {
                        continue;
                    }
                    let out = m.on(Event::Close, w.now);
                    if w.closed {
                        assert_eq!(out, []);
                    } else {
                        assert_eq!(out, [Action::FailPending, Action::Stop]);
                    }
                    w.closed = true;
                    if s.chance(50) {
                        let a = s.answer();
                        let beat = if s.chance(50) { Beat::Inline } else { Beat::Scheduled };
                        let want = w.answer(beat, a);
                        assert_eq!(m.on(hb(beat, a), w.now), want);
                        assert!(want.is_empty());
                        paths.closed_with_an_answer_after += 1;
                    }
                }
            }
            // Standing is the last answered heartbeat's.
            assert_eq!(m.is_registered(), matches!(w.last, Some(Answer::Accepted { .. })));
            assert_eq!(m.standing() == Standing::Refused, w.refused());
            assert_eq!(m.backfill_owed(), w.owed);
            assert_eq!(m.next_heartbeat(), w.next_due);
        }
        // Healed: no backfill left owed unless closed.
        assert!(w.closed || !w.owed, "a backfill still owed after healing");
        paths
    }

    /// Performs a backfill the machine asked for: fails now and then
    /// (fenced or not) unless healing.
    fn perform_backfill(
        m: &mut SessionMachine,
        w: &mut Model,
        s: &mut Script<'_>,
        out: &[Action],
        heal: bool,
        failed_before: &mut bool,
        paths: &mut Paths,
    ) {
        if !out.contains(&Action::Backfill) {
            return;
        }
        assert!(!w.closed, "a backfill after close");
        paths.backfills += 1;
        paths.backfills_after_a_failure += usize::from(*failed_before);
        *failed_before = false;
        if !heal && s.chance(25) {
            let fenced = s.chance(50);
            assert_eq!(m.on(Event::BackfillFailed { fenced }, w.now), []);
            w.owed = true;
            w.unconfirmed |= fenced;
            *failed_before = true;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// The schedule, the backoff bounds, confirmation, refusal, the
        /// owed backfill and close, as the module doc states them, under
        /// any answers, fenced writes, failed backfills, clock steps and
        /// closes.
        #[test]
        fn session_machine_invariants(script in proptest::collection::vec(any::<u8>(), 0..600)) {
            walk(&script);
        }
    }

    /// The walks reach every path the property is about (so it cannot pass
    /// by never getting there).
    #[test]
    fn the_walks_reach_every_path() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rand = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut t = Paths::default();
        for _ in 0..2000 {
            let script: Vec<u8> = (0..(rand() % 500)).map(|_| rand() as u8).collect();
            let p = walk(&script);
            t.backfills += p.backfills;
            t.backfills_after_a_failure += p.backfills_after_a_failure;
            t.refusals_taken_over += p.refusals_taken_over;
            t.fenced_while_refused += p.fenced_while_refused;
            t.inline_heartbeats += p.inline_heartbeats;
            t.capped_backoffs += p.capped_backoffs;
            t.closed_with_an_answer_after += p.closed_with_an_answer_after;
        }
        for (what, count) in [
            ("backfilled", t.backfills),
            ("backfilled again after a failure", t.backfills_after_a_failure),
            ("took over after a refusal", t.refusals_taken_over),
            ("fenced while refused", t.fenced_while_refused),
            ("heartbeat inline", t.inline_heartbeats),
            ("failed at the capped backoff", t.capped_backoffs),
            ("answered after close", t.closed_with_an_answer_after),
        ] {
            assert!(count > 0, "no walk {what}: {t:?}");
        }
    }
}
