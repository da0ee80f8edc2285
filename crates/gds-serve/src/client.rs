//! Which client a request comes from, and each client's requests in the engine (its share
//! of the queue). A leaf module: the connection loop (`net`), the front ends (`api`) and the
//! engine's requests (`scheduler`) all use it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

tokio::task_local! {
    /// The address of the client whose connection the current task serves (`net::serve` runs
    /// each connection, its requests and their streamed bodies in one task).
    pub(crate) static CLIENT: IpAddr;
}

/// Requests in the engine (queued or running) per client address, against each address's
/// share of the queue, so that one client cannot fill the queue and leave every other
/// client waiting behind it or refused.
#[derive(Default)]
pub(crate) struct ClientJobs(Mutex<HashMap<IpAddr, usize>>);

impl ClientJobs {
    /// A place for one more request of `ip`, unless it holds `share` already.
    pub(crate) fn take(self: &Arc<Self>, ip: IpAddr, share: usize) -> Option<ClientJob> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(ip).or_insert(0);
        if *n >= share {
            return None;
        }
        *n += 1;
        Some(ClientJob {
            jobs: self.clone(),
            ip,
        })
    }
}

/// One request of a client in the engine: its place is given back when the engine drops
/// the request (finished, failed or cancelled).
pub struct ClientJob {
    jobs: Arc<ClientJobs>,
    ip: IpAddr,
}

impl Drop for ClientJob {
    fn drop(&mut self) {
        let mut map = self.jobs.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}
