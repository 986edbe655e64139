//! A role's restart budget: `cluster.max_restarts` restarts within any
//! `cluster.restart_window_secs` (0: over the job's life). A job that runs
//! for days survives a death now and then; a role that keeps dying still
//! fails it. Launch keeps one per child process, the coordinator one per
//! role slot; the totals reported stay lifetime counts.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use sparrow_core::Config;

#[derive(Clone, Debug)]
pub struct RestartBudget {
    max: u32,
    window: Option<Duration>,
    /// When the restarts inside the window happened, oldest first.
    recent: VecDeque<Instant>,
}

impl RestartBudget {
    pub fn new(config: &Config) -> RestartBudget {
        let window = config.cluster.restart_window_secs;
        RestartBudget {
            max: config.cluster.max_restarts,
            window: (window > 0).then(|| Duration::from_secs(window)),
            recent: VecDeque::new(),
        }
    }

    /// A death at `now`: whether a restart is within the budget (then it
    /// counts), or the restarts inside the window, which spent it.
    pub fn spend(&mut self, now: Instant) -> Result<(), u32> {
        if let Some(window) = self.window {
            while self.recent.front().is_some_and(|&t| now.saturating_duration_since(t) >= window) {
                self.recent.pop_front();
            }
        }
        if self.recent.len() >= self.max as usize {
            return Err(self.recent.len() as u32);
        }
        self.recent.push_back(now);
        Ok(())
    }

    /// A spent budget in a message: `cluster.max_restarts = 3 is spent (3
    /// restart(s) within the last 3600 s, cluster.restart_window_secs)`.
    pub fn spent(&self, restarts: u32) -> String {
        let max = self.max;
        match self.window {
            Some(w) => format!(
                "cluster.max_restarts = {max} is spent ({restarts} restart(s) within the last {} s, \
                 cluster.restart_window_secs)",
                w.as_secs()
            ),
            None => {
                format!("cluster.max_restarts = {max} is spent (counted over the job's life: restart_window_secs = 0)")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(max: u32, window: u64) -> RestartBudget {
        let text = format!("[cluster]\nmax_restarts = {max}\nrestart_window_secs = {window}\n");
        RestartBudget::new(&Config::from_toml(&text, "t", &Default::default()).expect("config"))
    }

    /// Two restarts within the window spend a budget of two; once the first
    /// is a window old, one more is allowed. Without a window the count
    /// never falls; with max 0 no restart ever is.
    #[test]
    fn the_budget_refills_as_restarts_leave_the_window() {
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        let mut b = budget(2, 100);
        assert_eq!((b.spend(at(0)), b.spend(at(50))), (Ok(()), Ok(())));
        assert_eq!(b.spend(at(99)), Err(2), "two within 100 s");
        assert_eq!(b.spend(at(100)), Ok(()), "the first left the window");
        assert_eq!(b.spend(at(120)), Err(2));
        let mut lifetime = budget(2, 0);
        assert_eq!((lifetime.spend(at(0)), lifetime.spend(at(1000))), (Ok(()), Ok(())));
        assert_eq!(lifetime.spend(at(1_000_000)), Err(2));
        assert_eq!(budget(0, 100).spend(at(0)), Err(0));
        assert!(b.spent(2).contains("within the last 100 s"));
    }
}
