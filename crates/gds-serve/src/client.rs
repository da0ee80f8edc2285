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
    /// Set where the current task runs a request of the Batch APIs (`batches::drive`): its
    /// requests in the engine yield to clients' ([`crate::scheduler::Request::background`]).
    pub(crate) static BACKGROUND: bool;
}

/// The mark of a request made by a batch job (`gdsrun batch`, the server's Batch API) rather
/// than sent by a client: the API key is not asked of it (its batch's creator was asked), and
/// no client address holds it. A request extension, which nothing from the network can set.
#[derive(Clone, Copy)]
pub(crate) struct Internal;

/// What each client address holds (open connections in `net`; requests in the engine,
/// queued or running, in `api`), against a cap per address: one client cannot take every
/// connection, nor fill the queue and leave every other client waiting behind it or refused.
#[derive(Default)]
pub(crate) struct PerClient(Mutex<HashMap<IpAddr, usize>>);

impl PerClient {
    /// One more for `ip`, unless that address holds `cap` already.
    pub(crate) fn take(self: &Arc<Self>, ip: IpAddr, cap: usize) -> Option<ClientSlot> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(ip).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            held: self.clone(),
            ip,
        })
    }
}

/// One thing a client address holds (a connection; a request in the engine, given back when
/// the engine drops it: finished, failed or cancelled); uncounted on drop.
pub struct ClientSlot {
    held: Arc<PerClient>,
    ip: IpAddr,
}

impl ClientSlot {
    /// The client's address.
    pub(crate) fn ip(&self) -> IpAddr {
        self.ip
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut map = self.held.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_holds_at_most_its_cap_and_gets_slots_back() {
        let clients = Arc::new(PerClient::default());
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let held: Vec<ClientSlot> = (0..3).map(|_| clients.take(a, 3).unwrap()).collect();
        assert!(clients.take(a, 3).is_none());
        // another address is not affected
        let other = clients.take(b, 3).unwrap();
        drop(held);
        assert!(clients.take(a, 3).is_some());
        drop(other);
        assert!(clients.0.lock().unwrap().is_empty());
    }
}
