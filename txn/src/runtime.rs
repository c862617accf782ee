//! The smallest executor RDMA-style coroutines need.
//!
//! Every future in txn busy-polls: a pending one has already polled its completion
//! queue and will be ready once polled again after the memory server answers. So
//! wakers carry no information, and an executor is just "poll every unfinished future
//! in turn" (FORD's and Motor's coroutine schedulers work the same way). Using a general
//! async runtime here would only add a reactor and cross-thread wakeups to a loop that
//! never sleeps.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

/// Runs one future to completion on this thread, spinning between polls.
pub fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        // Inside a round of coroutines whose doorbells are held, this wait is not the
        // executor's: what it posted must go out now.
        fabric::ring_held_doorbells();
        std::hint::spin_loop();
    }
}

/// Runs futures concurrently on this thread (round robin, one poll each per round)
/// until all are done; `between_rounds` runs after every round with the number of
/// futures it polled (housekeeping such as flushing batched marks, and pacing).
/// Results come back in input order.
pub fn run_all<'a, T>(
    futures: Vec<Pin<Box<dyn Future<Output = T> + 'a>>>,
    mut between_rounds: impl FnMut(usize),
) -> Vec<T> {
    let mut cx = Context::from_waker(Waker::noop());
    let mut live: Vec<Option<Pin<Box<dyn Future<Output = T> + 'a>>>> =
        futures.into_iter().map(Some).collect();
    let mut results: Vec<Option<T>> = live.iter().map(|_| None).collect();
    let mut remaining = live.len();
    while remaining > 0 {
        let polled = remaining;
        for (slot, result) in live.iter_mut().zip(results.iter_mut()) {
            let Some(future) = slot else { continue };
            if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
                *result = Some(out);
                *slot = None;
                remaining -= 1;
            }
        }
        between_rounds(polled);
    }
    results
        .into_iter()
        .map(|r| r.expect("every future finished"))
        .collect()
}

/// Gives the other coroutines of this thread a turn: pending once, then ready.
pub fn yield_now() -> YieldNow {
    YieldNow { yielded: false }
}

pub struct YieldNow {
    yielded: bool,
}

impl Future for YieldNow {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[test]
    fn coroutines_interleave_at_yields() {
        let log = RefCell::new(Vec::new());
        let futures: Vec<Pin<Box<dyn Future<Output = usize> + '_>>> = (0..3usize)
            .map(|i| {
                let log = &log;
                Box::pin(async move {
                    for step in 0..2 {
                        log.borrow_mut().push((i, step));
                        yield_now().await;
                    }
                    i * 10
                }) as Pin<Box<dyn Future<Output = usize>>>
            })
            .collect();
        let mut polled = Vec::new();
        let out = run_all(futures, |n| polled.push(n));
        assert_eq!(out, vec![0, 10, 20]);
        assert_eq!(
            *log.borrow(),
            vec![(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
        );
        // Three rounds: every future polled in each (the last finishes them all).
        assert_eq!(polled, vec![3, 3, 3]);
    }

    #[test]
    fn block_on_finishes_a_yielding_future() {
        let out = block_on(async {
            yield_now().await;
            yield_now().await;
            7
        });
        assert_eq!(out, 7);
    }
}
