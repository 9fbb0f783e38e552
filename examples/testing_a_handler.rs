//! A handler's unit tests with PostgreSQL alone: no Redis, no dispatcher, no worker. `conveyor_jobs::testing::work`
//! (feature `testing`) runs one job through the handler in the test's own transaction and returns what it answered,
//! what a worker would record for it, and the transaction with the handler's writes, which the test reads and then
//! drops (rolled back: the test leaves nothing behind). Run with
//! `TEST_DATABASE_URL=postgres://… cargo test --features testing --example testing_a_handler`.

use conveyor_jobs::{Handler, JobContext, JobError, JobKind};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Refund part of an order.
#[derive(Serialize, Deserialize)]
pub struct Refund {
    /// The order.
    pub order_id: i64,
    /// How much to give back.
    pub cents: i64,
}

impl JobKind for Refund {
    const KIND: &'static str = "example.refund";
    const QUEUE: &'static str = "example-refunds";
    const MAX_ATTEMPTS: u32 = 5;
}

/// Gives back part of what an order paid, never more than was paid.
pub struct Refunds;

impl Handler<Refund> for Refunds {
    async fn handle(&self, job: Refund, cx: &mut JobContext) -> Result<Value, JobError> {
        let paid: Option<i64> = sqlx::query_scalar(
            "UPDATE orders SET refunded_cents = refunded_cents + $2
             WHERE id = $1 AND refunded_cents + $2 <= paid_cents RETURNING paid_cents - refunded_cents",
        )
        .bind(job.order_id)
        .bind(job.cents)
        .fetch_optional(&mut **cx.tx().await?)
        .await?;
        match paid {
            Some(left) => Ok(json!({ "refundable_left": left })),
            None => Err(JobError::permanent("more than was paid, or no such order")),
        }
    }
}

fn main() {
    println!("this example is its tests: cargo test --features testing --example testing_a_handler");
}

#[cfg(test)]
mod tests {
    use super::*;
    use conveyor_jobs::Outcome;
    use conveyor_jobs::testing::work;

    /// A transaction on the test database (Conveyor's schema applied) with an order of 5000 cents paid in it.
    async fn with_an_order() -> conveyor_jobs::WorkspaceTx {
        let url = std::env::var("TEST_DATABASE_URL")
            // scripts/services.sh's development database, as its owner.
            .unwrap_or_else(|_| "postgres://conveyor_owner:conveyor_owner@127.0.0.1:5432/conveyor".into());
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        conveyor_jobs::migrate(&pool).await.unwrap();
        let mut tx = conveyor_jobs::begin(&pool).await.unwrap();
        // DDL is transactional: the table goes with the rollback.
        sqlx::query("CREATE TEMP TABLE orders (id bigint PRIMARY KEY, paid_cents bigint, refunded_cents bigint)")
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("INSERT INTO orders VALUES (1, 5000, 0)").execute(&mut *tx).await.unwrap();
        tx
    }

    #[tokio::test]
    async fn a_refund_within_what_was_paid_succeeds_and_writes_in_the_jobs_transaction() {
        let mut worked = work(&Refunds, with_an_order().await, Refund { order_id: 1, cents: 1200 }).await;
        assert_eq!(worked.outcome, Outcome::Succeeded);
        assert_eq!(worked.result.unwrap(), json!({ "refundable_left": 3800 }));
        let refunded: i64 = sqlx::query_scalar("SELECT refunded_cents FROM orders WHERE id = 1")
            .fetch_one(&mut *worked.tx)
            .await
            .unwrap();
        assert_eq!(refunded, 1200);
    }

    #[tokio::test]
    async fn a_refund_over_what_was_paid_is_dead_lettered_not_retried() {
        let worked = work(&Refunds, with_an_order().await, Refund { order_id: 1, cents: 9000 }).await;
        assert_eq!(worked.outcome, Outcome::DeadLettered);
    }
}
