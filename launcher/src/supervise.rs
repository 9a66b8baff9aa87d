//! Watching a started job until it ends: failures, the scheduler's verdict, the servers'
//! exit after the workers', an interrupt.

use super::*;

/// How a job ended, as `supervise` saw it.
pub(crate) enum Ended {
    /// With this status (0: every process, and the scheduler, ended well).
    Status(i32),
    /// Every process ended with status 0, but the scheduler had not ended: none of them
    /// joined the job (a program that is no kvstore job's, or forgot `create`), or some did.
    SchedulerWaiting { any_joined: bool },
}

/// The signals kvrun passes on to the job's processes (as mpirun passes SIGUSR1 and SIGUSR2:
/// a batch system's warning before the time limit, on which a program saves a checkpoint).
pub(crate) struct Forwarded {
    seen: Vec<(libc::c_int, Arc<AtomicBool>)>,
    told_remote: bool,
}

impl Forwarded {
    pub(crate) fn register() -> Result<Forwarded, String> {
        let mut seen = Vec::new();
        for sig in [signal_hook::consts::SIGUSR1, signal_hook::consts::SIGUSR2] {
            let flag = Arc::new(AtomicBool::new(false));
            signal_hook::flag::register(sig, flag.clone())
                .map_err(|e| format!("signal handler: {e}"))?;
            seen.push((sig, flag));
        }
        Ok(Forwarded {
            seen,
            told_remote: false,
        })
    }

    /// Passes each signal received since the last look to every process group of the job on
    /// this host. Processes on other hosts do not get it: their ssh client would die of it.
    fn deliver(&mut self, children: &mut [Child]) {
        for (sig, flag) in &self.seen {
            if !flag.swap(false, Ordering::Relaxed) {
                continue;
            }
            let mut remote = false;
            for c in children.iter_mut() {
                remote |= !c.forward(*sig);
            }
            if remote && !self.told_remote {
                self.told_remote = true;
                say(&format!(
                    "{} is passed on to this host's processes only, not to those on other hosts",
                    child::signal_name(*sig)
                ));
            }
        }
    }
}

/// kvrun's status when a signal stopped it: 128 + the signal's number, as a shell gives it
/// (130 where the signal is not known).
pub(crate) fn stopped_status(stopped_by: &AtomicUsize) -> i32 {
    match stopped_by.load(Ordering::Relaxed) {
        0 => 128 + libc::SIGINT,
        n => 128 + n as i32,
    }
}

/// Watches the processes until the job ends; says how it ended.
pub(crate) fn supervise(
    children: &mut [Child],
    (stop, stopped_by): (&AtomicBool, &AtomicUsize),
    forwarded: &mut Forwarded,
    sched_rx: &mpsc::Receiver<kvstore::Result<()>>,
    opts: &Options,
    view: &mut view::View,
) -> Ended {
    let mut workers_done_at: Option<Instant> = None;
    let mut sched_result: Option<kvstore::Result<()>> = None;
    loop {
        if stop.load(Ordering::Relaxed) {
            say("interrupted: stopping every process");
            return Ended::Status(stopped_status(stopped_by));
        }
        forwarded.deliver(children);
        if sched_result.is_none() {
            if let Ok(r) = sched_rx.try_recv() {
                sched_result = Some(r);
            }
        }
        for c in children.iter_mut() {
            c.poll();
        }
        view.update(children, say);
        // Failures seen now.
        let mut failed: Vec<Failure> = Vec::new();
        Failure::collect(children, &mut failed);
        if !failed.is_empty() {
            // Give the others a moment to report too (until all ended, 500 ms at most). Of the
            // failures seen by then, one killed by a signal is the likelier cause (the others
            // ended because of it) and is named first: its status can come after theirs (a
            // core being written, a remote one's status passed on by ssh). The others follow
            // in the order seen.
            let until = Instant::now() + Duration::from_millis(500);
            while Instant::now() < until && !children.iter().all(|c| c.exited()) {
                std::thread::sleep(Duration::from_millis(20));
                Failure::collect(children, &mut failed);
            }
            failed.sort_by_key(|f| !f.signal);
            let Failure {
                what: first, code, ..
            } = failed.remove(0);
            let then: Vec<String> = failed.into_iter().map(|f| f.what).collect();
            let then = if then.is_empty() {
                String::new()
            } else {
                format!("; then {}", then.join("; "))
            };
            say(&format!("first failure: {first}{then}; stopping the job"));
            // The scheduler's own verdict, where it reached one: it can name the cause the
            // failures above only follow from (a process stopped, not exited, say).
            if sched_result.is_none() {
                sched_result = sched_rx.recv_timeout(Duration::from_millis(300)).ok();
            }
            if let Some(Err(e)) = &sched_result {
                say(&format!("scheduler: {e}"));
            }
            // As mpirun: the job's status is the first failure's own.
            return Ended::Status(code);
        }
        let workers_done = children
            .iter()
            .filter(|c| matches!(c.role, RoleName::Worker(_)))
            .all(|c| c.exited());
        if workers_done {
            let t = *workers_done_at.get_or_insert_with(Instant::now);
            if children.iter().all(|c| c.exited()) {
                if sched_result.is_none() {
                    // The scheduler's end comes just after the processes' (or never, where
                    // one never joined the job: a program that is not a kvstore job's).
                    sched_result = sched_rx.recv_timeout(Duration::from_millis(500)).ok();
                }
                return match sched_result {
                    Some(Err(e)) => {
                        say(&format!("scheduler: {e}"));
                        Ended::Status(1)
                    }
                    Some(Ok(())) => Ended::Status(0),
                    None => {
                        // Their last reports, then a warning for each that never joined.
                        view.update(children, say);
                        view.warn_unjoined(children, true, say);
                        Ended::SchedulerWaiting {
                            any_joined: view.any_joined(),
                        }
                    }
                };
            }
            if t.elapsed() > Duration::from_secs_f64(opts.grace) {
                say("the workers are done but the servers did not exit in time; stopping them");
                return Ended::Status(1);
            }
        }
        if let Some(Err(e)) = &sched_result {
            // The scheduler aborted the job: the processes are told; give them a moment.
            let t = *workers_done_at.get_or_insert_with(Instant::now);
            if t.elapsed() > Duration::from_secs(5) {
                say(&format!("scheduler: {e}"));
                return Ended::Status(1);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
