//! PostgreSQL at REPEATABLE READ (its snapshot isolation) as a baseline [`System`].
//!
//! The ten relations are real tables with typed columns (every field of the row
//! structs of [`crate::schema`]), keyed by the row's id; the two line tables, whose
//! keys are packed, lead with the packed key (`ol_key`, `scl_key`) before their
//! natural columns. A [`Session`] operation is one prepared statement, cached per
//! connection: `get` a `SELECT` by key, `get_many` one `= ANY($1)`, `put` an
//! `INSERT … ON CONFLICT DO UPDATE` of every column, `insert` an `INSERT`, `delete` a
//! `DELETE`. Rows cross the interface as the bytes of the structs' `encode`.
//!
//! Each engine owns one connection, and PostgreSQL's calls block, so an engine runs
//! one client ([`System::max_clients_per_thread`] is 1). Aborts: a serialization
//! failure (40001) or deadlock (40P01) is [`AbortReason::Conflict`], a unique violation
//! (23505) [`AbortReason::DuplicateKey`]. Keys and ids are `u64`, PostgreSQL's `BIGINT`
//! is signed: values up to 2^63 − 1 map losslessly, larger ones are an error (and
//! `u32` columns are `INTEGER`, up to 2^31 − 1).
//!
//! [`Postgres::start_local`] and [`Postgres::start_scratch`] run a server through
//! `scripts/postgres.sh` (see its header for the configuration; built into the
//! binary, [`BUILT_IN`]) for the runner.

use crate::load::{UNITS, generated_rows};
use crate::schema::*;
use crate::system::{AbortReason, ClientFuture, Committed, Engine, Error, Result, Session, System};
use postgres::binary_copy::BinaryCopyInWriter;
use postgres::error::SqlState;
use postgres::types::{FromSql, ToSql, Type};
use postgres::{Client, NoTls, Statement};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

pub use crate::script::Script;

/// `scripts/postgres.sh`, built in ([`Script::BuiltIn`]): written into the server's
/// directory when the server starts, so it is removed with a scratch directory and
/// nothing is left behind even when this process is killed (the script's watcher
/// removes the directory).
pub static BUILT_IN: crate::script::BuiltIn = crate::script::BuiltIn {
    name: "postgres.sh",
    text: include_str!("../../scripts/postgres.sh"),
    beside: &[(
        "apt-install.sh",
        include_str!("../../scripts/apt-install.sh"),
    )],
};

/// What a table takes per row beyond the row's encoded bytes: the tuple header and
/// line pointer, alignment, the primary key's index entry and pages' free space.
/// Measured (`pg_database_size` after a load, 10 000 items): 67 MB at `--ebs 10` and
/// 249 MB at `--ebs 50`, which add 857 520 rows of 131 MB: 60 bytes per row more.
const BYTES_PER_ROW: u64 = 64;
/// An empty database's catalog (about 7.5 MB).
const EMPTY_DATABASE_BYTES: u64 = 8 << 20;
/// The write-ahead log a load leaves behind: `max_wal_size`'s default, which
/// `scripts/postgres.sh` keeps (checkpoints start as it fills, so the log stays near it).
pub const WAL_BYTES: u64 = 1 << 30;

/// The disk space the database takes once `scale`'s population is loaded, its
/// write-ahead log included (a run's inserts come on top).
pub fn loaded_bytes(scale: &Scale) -> u64 {
    let population = crate::load::population(scale);
    population
        .bytes
        .saturating_add(population.rows.saturating_mul(BYTES_PER_ROW))
        .saturating_add(EMPTY_DATABASE_BYTES + WAL_BYTES)
}

/// The directory [`Postgres::start_scratch`] makes its server's directory in.
pub fn scratch_parent() -> PathBuf {
    std::env::temp_dir()
}

/// A PostgreSQL database that holds (or will hold) the TPC-W tables.
pub struct Postgres {
    config: postgres::Config,
    /// `user@host:port/dbname`, for messages (a connection string may hold a password).
    target: String,
}

impl Postgres {
    /// Connects to the database of `conn_str` (`host=… port=… user=… dbname=…` or a
    /// `postgresql://` URL) once, to fail early when it is wrong or unreachable.
    pub fn connect(conn_str: &str) -> Result<Postgres> {
        let mut config: postgres::Config = conn_str.parse().map_err(|e| {
            // Not echoed: a connection string may hold a password.
            Error::System(format!(
                "invalid PostgreSQL connection string: {}",
                error_text(&e)
            ))
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        config.application_name("namdb-tpcw");
        let target = describe(&config);
        let postgres = Postgres { config, target };
        postgres.client()?;
        Ok(postgres)
    }

    /// Starts (or finds running) the server in `dir` with `script` and connects to it.
    /// The server stops when the returned [`LocalServer`] is dropped, or when this
    /// process exits without dropping it.
    pub fn start_local(script: &Script, dir: &Path) -> Result<(Postgres, LocalServer)> {
        LocalServer::start(script, dir, false)
    }

    /// Like [`Postgres::start_local`], in a fresh temporary directory that is deleted
    /// when the server stops.
    pub fn start_scratch(script: &Script) -> Result<(Postgres, LocalServer)> {
        let dir = tempfile::Builder::new()
            .prefix("namdb-postgres-")
            .tempdir_in(scratch_parent())
            .map_err(|e| Error::System(format!("cannot make a temporary directory: {e}")))?
            .keep();
        LocalServer::start(script, &dir, true)
    }

    /// Drops the ten tables if they exist and creates them empty, with their keys.
    pub fn create_schema(&self) -> Result<()> {
        create_tables(&mut self.client()?, true)
    }

    fn client(&self) -> Result<Client> {
        self.config.connect(NoTls).map_err(|e| {
            Error::System(format!(
                "cannot connect to PostgreSQL at {}: {}",
                self.target,
                error_text(&e)
            ))
        })
    }

    /// Loads the rows of `unit` whose ids this thread takes from `counters.next`, with one
    /// binary COPY per relation the unit makes (an order brings its lines and its
    /// credit-card transaction).
    fn copy_unit(&self, scale: &Scale, unit: Rel, counters: &LoadCounters<'_>) -> Result<()> {
        let rels = unit_relations(unit);
        let mut clients = rels
            .iter()
            .map(|_| self.client())
            .collect::<Result<Vec<_>>>()?;
        let mut writers = Vec::with_capacity(rels.len());
        for (client, &rel) in clients.iter_mut().zip(rels) {
            let table = table(rel);
            let sink = client
                .copy_in(&format!(
                    "COPY {} ({}) FROM STDIN (FORMAT binary)",
                    rel.name(),
                    table.column_list()
                ))
                .map_err(|e| db_error(e, || format!("starting the COPY into {}", rel.name())))?;
            writers.push(BinaryCopyInWriter::new(
                sink,
                &counters.column_types[rel.index()],
            ));
        }
        let total = scale.rows(unit);
        let mut rows = Vec::new();
        while !counters.failed.load(Ordering::Relaxed) {
            let first = counters.next.fetch_add(LOAD_CHUNK, Ordering::Relaxed);
            if first > total {
                for (writer, rel) in writers.into_iter().zip(rels) {
                    writer.finish().map_err(|e| {
                        db_error(e, || format!("finishing the COPY into {}", rel.name()))
                    })?;
                }
                return Ok(());
            }
            let last = (first + LOAD_CHUNK - 1).min(total);
            for id in first..=last {
                rows.clear();
                generated_rows(scale, unit, id, &mut rows);
                for (rel, key, bytes) in &rows {
                    let slot = rels.iter().position(|r| r == rel).ok_or_else(|| {
                        Error::System(format!(
                            "the generator made a {} row for a {} unit",
                            rel.name(),
                            unit.name()
                        ))
                    })?;
                    let values = (table(*rel).params)(*key, bytes)?;
                    writers[slot]
                        .write(&param_refs(&values))
                        .map_err(|e| db_error(e, || format!("copying {} row {key}", rel.name())))?;
                }
            }
            let count = last - first + 1;
            let done = counters.done.fetch_add(count, Ordering::Relaxed) + count;
            (counters.progress)(unit, done, total);
        }
        // Another thread failed and reports why; dropping the writers cancels the COPYs.
        Ok(())
    }
}

/// Ids a loader thread takes at a time.
const LOAD_CHUNK: u64 = 1_000;

/// What the loader threads of one unit share.
struct LoadCounters<'a> {
    next: AtomicU64,
    done: AtomicU64,
    failed: AtomicBool,
    column_types: &'a [Vec<Type>],
    progress: &'a (dyn Fn(Rel, u64, u64) + Sync),
}

/// The relations whose rows a unit of [`UNITS`] makes.
fn unit_relations(unit: Rel) -> &'static [Rel] {
    match unit {
        Rel::Country => &[Rel::Country],
        Rel::Author => &[Rel::Author],
        Rel::Item => &[Rel::Item],
        Rel::Customer => &[Rel::Customer],
        Rel::Address => &[Rel::Address],
        Rel::Orders => &[Rel::Orders, Rel::OrderLine, Rel::CcXacts],
        Rel::NewProducts => &[Rel::NewProducts],
        Rel::OrderLine | Rel::CcXacts | Rel::ShoppingCart | Rel::ShoppingCartLine => &[],
    }
}

fn describe(config: &postgres::Config) -> String {
    let host = match config.get_hosts().first() {
        Some(postgres::config::Host::Tcp(host)) => host.clone(),
        Some(postgres::config::Host::Unix(path)) => path.display().to_string(),
        None => "localhost".to_string(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{}@{host}:{port}/{}",
        config.get_user().unwrap_or("(no user)"),
        config.get_dbname().unwrap_or("(default database)")
    )
}

impl System for Postgres {
    type Engine = PgEngine;

    fn name(&self) -> &'static str {
        "postgres"
    }

    fn backend(&self) -> String {
        "tcp".to_string()
    }

    fn engine(&self, _thread: usize) -> Result<PgEngine> {
        Ok(PgEngine {
            conn: RefCell::new(Connection {
                client: self.client()?,
                statements: HashMap::new(),
            }),
            open: Cell::new(false),
            broken: RefCell::new(None),
        })
    }

    fn max_clients_per_thread(&self) -> usize {
        1
    }

    /// Creates the tables without keys, COPYs the generated rows in on several
    /// connections at once, then adds the primary keys (one index build per table is
    /// faster than maintaining it row by row) and runs `VACUUM ANALYZE`.
    fn load(&self, scale: &Scale, progress: &(dyn Fn(Rel, u64, u64) + Sync)) -> Result<()> {
        let mut control = self.client()?;
        create_tables(&mut control, false)?;
        let column_types = Rel::ALL
            .iter()
            .map(|&rel| {
                control
                    .prepare(&Op::Insert.sql(table(rel)))
                    .map(|statement| statement.params().to_vec())
                    .map_err(|e| {
                        db_error(e, || format!("preparing the insert into {}", rel.name()))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 8));
        for unit in UNITS {
            let counters = LoadCounters {
                next: AtomicU64::new(1),
                done: AtomicU64::new(0),
                failed: AtomicBool::new(false),
                column_types: &column_types,
                progress,
            };
            in_threads(threads, || {
                let outcome = self.copy_unit(scale, unit, &counters);
                if outcome.is_err() {
                    counters.failed.store(true, Ordering::Relaxed);
                }
                outcome
            })?;
        }
        let pending = Mutex::new(Rel::ALL.to_vec());
        in_threads(threads, || {
            let mut client = self.client()?;
            loop {
                let next = pending
                    .lock()
                    .map(|mut rels| rels.pop())
                    .map_err(|_| Error::System("a thread adding primary keys panicked".into()))?;
                let Some(rel) = next else { return Ok(()) };
                client
                    .batch_execute(&format!(
                        "ALTER TABLE {} ADD PRIMARY KEY ({})",
                        rel.name(),
                        table(rel).key_column()
                    ))
                    .map_err(|e| db_error(e, || format!("adding the key of {}", rel.name())))?;
            }
        })?;
        // VACUUM also sets the rows' hint bits, which the first reads of the measured
        // run would otherwise write back page by page.
        control
            .batch_execute("VACUUM ANALYZE")
            .map_err(|e| db_error(e, || "running VACUUM ANALYZE".to_string()))
    }
}

/// Runs `work` on `threads` threads and returns the first error.
fn in_threads(threads: usize, work: impl Fn() -> Result<()> + Sync) -> Result<()> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(&work)).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::System("a loader thread panicked".into())))
            })
            .collect::<Vec<_>>()
    })
    .into_iter()
    .collect()
}

fn create_tables(client: &mut Client, with_keys: bool) -> Result<()> {
    let names: Vec<&str> = Rel::ALL.iter().map(|rel| rel.name()).collect();
    let mut sql = format!("DROP TABLE IF EXISTS {};\n", names.join(", "));
    for rel in Rel::ALL {
        let table = table(rel);
        let mut columns: Vec<String> = table
            .columns
            .iter()
            .map(|(name, sql_type)| format!("{name} {sql_type} NOT NULL"))
            .collect();
        if with_keys {
            columns.push(format!("PRIMARY KEY ({})", table.key_column()));
        }
        sql.push_str(&format!(
            "CREATE TABLE {} ({});\n",
            rel.name(),
            columns.join(", ")
        ));
    }
    client
        .batch_execute(&sql)
        .map_err(|e| db_error(e, || "creating the tables".to_string()))
}

/// `e` with its causes: postgres's own `Display` leaves out the server's message.
fn error_text(e: &postgres::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string().replace('\n', "; "));
        cause = c.source();
    }
    text
}

/// Classifies a PostgreSQL error; `doing` says what failed.
fn db_error(e: postgres::Error, doing: impl FnOnce() -> String) -> Error {
    let reason = match e.code() {
        Some(code)
            if *code == SqlState::T_R_SERIALIZATION_FAILURE
                || *code == SqlState::T_R_DEADLOCK_DETECTED =>
        {
            Some(AbortReason::Conflict)
        }
        Some(code) if *code == SqlState::UNIQUE_VIOLATION => Some(AbortReason::DuplicateKey),
        _ => None,
    };
    let text = error_text(&e);
    if let Some(reason) = reason {
        return Error::aborted(reason, format!("{}: {text}", doing()));
    }
    match e.code() {
        // Class 22, data exceptions: a value the column does not take (a string too
        // long for its VARCHAR, say).
        Some(code) if code.code().starts_with("22") => {
            Error::Data(format!("PostgreSQL rejected a value {}: {text}", doing()))
        }
        _ if e.is_closed() => Error::System(format!(
            "the connection to PostgreSQL closed while {}: {text}",
            doing()
        )),
        _ => Error::System(format!("PostgreSQL failed {}: {text}", doing())),
    }
}

// ----------------------------------------------------------------- tables

type Param = Box<dyn ToSql + Sync>;

fn param_refs(values: &[Param]) -> Vec<&(dyn ToSql + Sync)> {
    values.iter().map(|v| &**v as &(dyn ToSql + Sync)).collect()
}

/// A relation's table: its columns, and how a row's bytes become column values and
/// back.
struct Table {
    rel: Rel,
    /// Name and SQL type of each column, the key first.
    columns: &'static [(&'static str, &'static str)],
    /// The column values of row `bytes` stored at `key`, after checking that the row
    /// belongs there.
    params: fn(u64, &[u8]) -> Result<Vec<Param>>,
    /// The encoded row of a result row that selected `columns` in order.
    row: fn(&postgres::Row) -> Result<Vec<u8>>,
}

impl Table {
    fn key_column(&self) -> &'static str {
        self.columns[0].0
    }

    fn column_list(&self) -> String {
        let names: Vec<&str> = self.columns.iter().map(|(name, _)| *name).collect();
        names.join(", ")
    }
}

/// How a field of a row struct is stored: as itself or, for the unsigned types that
/// PostgreSQL lacks, as the signed type of the same width (when it fits).
trait Column: Sized {
    type Sql: ToSql + for<'a> FromSql<'a> + Sync + 'static;
    fn into_sql(self) -> Result<Self::Sql, String>;
    fn from_sql(value: Self::Sql) -> Result<Self, String>;
}

impl Column for u64 {
    type Sql = i64;
    fn into_sql(self) -> Result<i64, String> {
        i64::try_from(self)
            .map_err(|_| format!("{self} does not fit PostgreSQL's BIGINT (at most 2^63 - 1)"))
    }
    fn from_sql(value: i64) -> Result<u64, String> {
        u64::try_from(value).map_err(|_| format!("{value} is negative"))
    }
}

impl Column for u32 {
    type Sql = i32;
    fn into_sql(self) -> Result<i32, String> {
        i32::try_from(self)
            .map_err(|_| format!("{self} does not fit PostgreSQL's INTEGER (at most 2^31 - 1)"))
    }
    fn from_sql(value: i32) -> Result<u32, String> {
        u32::try_from(value).map_err(|_| format!("{value} is negative"))
    }
}

macro_rules! stored_as_itself {
    ($($ty:ty),*) => {$(
        impl Column for $ty {
            type Sql = $ty;
            fn into_sql(self) -> Result<$ty, String> {
                Ok(self)
            }
            fn from_sql(value: $ty) -> Result<$ty, String> {
                Ok(value)
            }
        }
    )*};
}
stored_as_itself!(i64, i32, f64, String);

/// NEW_PRODUCTS' list of (publication date, item) pairs, as a flat BIGINT[].
impl Column for Vec<(i64, u64)> {
    type Sql = Vec<i64>;
    fn into_sql(self) -> Result<Vec<i64>, String> {
        let mut flat = Vec::with_capacity(self.len() * 2);
        for (date, id) in self {
            flat.push(date);
            flat.push(id.into_sql()?);
        }
        Ok(flat)
    }
    fn from_sql(value: Vec<i64>) -> Result<Self, String> {
        if !value.len().is_multiple_of(2) {
            return Err(format!("{} values, not (date, item) pairs", value.len()));
        }
        value
            .chunks_exact(2)
            .map(|p| Ok((p[0], u64::from_sql(p[1])?)))
            .collect()
    }
}

fn param<T: Column>(rel: Rel, column: &str, value: T) -> Result<Param> {
    match value.into_sql() {
        Ok(v) => Ok(Box::new(v)),
        Err(e) => Err(Error::Data(format!("{}.{column}: {e}", rel.name()))),
    }
}

/// The column at `*at` of `row`, advancing `*at`.
fn column<T: Column>(rel: Rel, row: &postgres::Row, at: &mut usize, name: &str) -> Result<T> {
    let index = *at;
    *at += 1;
    let value: T::Sql = row
        .try_get(index)
        .map_err(|e| Error::Data(format!("{}.{name}: {}", rel.name(), error_text(&e))))?;
    T::from_sql(value).map_err(|e| Error::Data(format!("{}.{name}: {e}", rel.name())))
}

fn misplaced(rel: Rel, key: u64, what: String) -> Error {
    Error::Data(format!(
        "a row of {} cannot be stored at key {key}: {what}",
        rel.name()
    ))
}

macro_rules! table {
    // Keyed by the row's own id column.
    ($rel:expr, $ty:ident, key $key:ident, { $($field:ident $sql:literal),* $(,)? }) => {
        Table {
            rel: $rel,
            columns: &[$((stringify!($field), $sql)),*],
            params: |key, bytes| {
                let $ty { $($field),* } = $ty::decode(bytes)?;
                if $key != key {
                    return Err(misplaced($rel, key, format!("its {} is {}", stringify!($key), $key)));
                }
                Ok(vec![$(param($rel, stringify!($field), $field)?),*])
            },
            row: |row| {
                let mut at = 0;
                Ok($ty { $($field: column($rel, row, &mut at, stringify!($field))?),* }.encode())
            },
        }
    };
    // Keyed by a packed key column in front of the row's columns; `belongs` says
    // whether row `$row` may be stored at key `$k`.
    ($rel:expr, $ty:ident, packed $key:literal, belongs |$k:ident, $row:ident| $belongs:expr,
     { $($field:ident $sql:literal),* $(,)? }) => {
        Table {
            rel: $rel,
            columns: &[($key, "BIGINT"), $((stringify!($field), $sql)),*],
            params: |key, bytes| {
                let $row = $ty::decode(bytes)?;
                let $k = key;
                if !$belongs {
                    return Err(misplaced($rel, key, format!("{:?}", $row)));
                }
                let $ty { $($field),* } = $row;
                Ok(vec![param($rel, $key, key)?, $(param($rel, stringify!($field), $field)?),*])
            },
            row: |row| {
                let mut at = 1;
                Ok($ty { $($field: column($rel, row, &mut at, stringify!($field))?),* }.encode())
            },
        }
    };
}

// String lengths are TPC-W's (clause 1.3), which the generator keeps to; the item's
// description is TEXT because it pads the row to the scale's item size.
const COUNTRY: Table = table!(Rel::Country, Country, key co_id, {
    co_id "BIGINT", co_name "VARCHAR(50)", co_exchange "DOUBLE PRECISION",
    co_currency "VARCHAR(18)",
});

const AUTHOR: Table = table!(Rel::Author, Author, key a_id, {
    a_id "BIGINT", a_fname "VARCHAR(20)", a_lname "VARCHAR(20)", a_mname "VARCHAR(20)",
    a_dob "BIGINT", a_bio "VARCHAR(500)",
});

const ITEM: Table = table!(Rel::Item, Item, key i_id, {
    i_id "BIGINT", i_stock "INTEGER", i_cost "BIGINT", i_srp "BIGINT", i_a_id "BIGINT",
    i_pub_date "BIGINT", i_avail "BIGINT", i_page "INTEGER", i_related1 "BIGINT",
    i_related2 "BIGINT", i_related3 "BIGINT", i_related4 "BIGINT", i_related5 "BIGINT",
    i_title "VARCHAR(60)", i_publisher "VARCHAR(60)", i_subject "VARCHAR(60)",
    i_desc "TEXT", i_thumbnail "VARCHAR(100)", i_image "VARCHAR(100)",
    i_isbn "VARCHAR(13)", i_backing "VARCHAR(15)", i_dimensions "VARCHAR(25)",
});

const CUSTOMER: Table = table!(Rel::Customer, Customer, key c_id, {
    // The user name, password and e-mail hold stream ids (schema::UNAME_MAX, EMAIL_MAX).
    c_id "BIGINT", c_uname "VARCHAR(38)", c_passwd "VARCHAR(38)", c_fname "VARCHAR(15)",
    c_lname "VARCHAR(15)", c_addr_id "BIGINT", c_phone "VARCHAR(16)",
    c_email "VARCHAR(52)", c_since "BIGINT", c_last_login "BIGINT", c_login "BIGINT",
    c_expiration "BIGINT", c_discount "INTEGER", c_balance "BIGINT", c_ytd_pmt "BIGINT",
    c_birthdate "BIGINT", c_data "VARCHAR(500)", c_last_o_id "BIGINT",
});

const ADDRESS: Table = table!(Rel::Address, Address, key addr_id, {
    addr_id "BIGINT", addr_street1 "VARCHAR(40)", addr_street2 "VARCHAR(40)",
    addr_city "VARCHAR(30)", addr_state "VARCHAR(20)", addr_zip "VARCHAR(10)",
    addr_co_id "BIGINT",
});

const ORDERS: Table = table!(Rel::Orders, Order, key o_id, {
    o_id "BIGINT", o_c_id "BIGINT", o_date "BIGINT", o_sub_total "BIGINT", o_tax "BIGINT",
    o_total "BIGINT", o_ship_type "VARCHAR(10)", o_ship_date "BIGINT",
    o_bill_addr_id "BIGINT", o_ship_addr_id "BIGINT", o_status "VARCHAR(15)",
    o_num_lines "INTEGER",
});

const ORDER_LINE: Table = table!(Rel::OrderLine, OrderLine, packed "ol_key",
belongs |key, row| row.ol_id < MAX_LINES
    && row.ol_o_id.checked_mul(MAX_LINES).and_then(|k| k.checked_add(row.ol_id)) == Some(key),
{
    ol_id "BIGINT", ol_o_id "BIGINT", ol_i_id "BIGINT", ol_qty "INTEGER",
    ol_discount "INTEGER", ol_comments "VARCHAR(100)",
});

const CC_XACTS: Table = table!(Rel::CcXacts, CcXact, key cx_o_id, {
    cx_o_id "BIGINT", cx_type "VARCHAR(10)", cx_num "VARCHAR(20)", cx_name "VARCHAR(30)",
    cx_expire "BIGINT", cx_auth_id "VARCHAR(15)", cx_xact_amt "BIGINT",
    cx_xact_date "BIGINT", cx_co_id "BIGINT",
});

const SHOPPING_CART: Table = table!(Rel::ShoppingCart, ShoppingCart, key sc_id, {
    sc_id "BIGINT", sc_time "BIGINT", sc_num_lines "INTEGER",
});

const SHOPPING_CART_LINE: Table = table!(Rel::ShoppingCartLine, ShoppingCartLine,
    packed "scl_key", belongs |key, row| key / MAX_LINES == row.scl_sc_id,
    { scl_sc_id "BIGINT", scl_qty "INTEGER", scl_i_id "BIGINT" });

const NEW_PRODUCTS: Table = table!(Rel::NewProducts, NewProducts, key np_subject, {
    np_subject "BIGINT", items "BIGINT[]",
});

fn table(rel: Rel) -> &'static Table {
    match rel {
        Rel::Country => &COUNTRY,
        Rel::Author => &AUTHOR,
        Rel::Item => &ITEM,
        Rel::Customer => &CUSTOMER,
        Rel::Address => &ADDRESS,
        Rel::Orders => &ORDERS,
        Rel::OrderLine => &ORDER_LINE,
        Rel::CcXacts => &CC_XACTS,
        Rel::ShoppingCart => &SHOPPING_CART,
        Rel::ShoppingCartLine => &SHOPPING_CART_LINE,
        Rel::NewProducts => &NEW_PRODUCTS,
    }
}

/// The statements a session prepares per table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Op {
    Get,
    GetMany,
    Upsert,
    Insert,
    Delete,
}

impl Op {
    fn sql(self, table: &Table) -> String {
        let name = table.rel.name();
        let key = table.key_column();
        let columns = table.column_list();
        let placeholders: Vec<String> =
            (1..=table.columns.len()).map(|i| format!("${i}")).collect();
        let placeholders = placeholders.join(", ");
        match self {
            Op::Get => format!("SELECT {columns} FROM {name} WHERE {key} = $1"),
            Op::GetMany => format!("SELECT {columns} FROM {name} WHERE {key} = ANY($1)"),
            Op::Insert => format!("INSERT INTO {name} ({columns}) VALUES ({placeholders})"),
            Op::Upsert => {
                let updates: Vec<String> = table.columns[1..]
                    .iter()
                    .map(|(column, _)| format!("{column} = EXCLUDED.{column}"))
                    .collect();
                format!(
                    "INSERT INTO {name} ({columns}) VALUES ({placeholders}) \
                     ON CONFLICT ({key}) DO UPDATE SET {}",
                    updates.join(", ")
                )
            }
            Op::Delete => format!("DELETE FROM {name} WHERE {key} = $1"),
        }
    }
}

// ----------------------------------------------------------------- engine

/// One runner thread's connection.
pub struct PgEngine {
    conn: RefCell<Connection>,
    /// A transaction of this engine is open.
    open: Cell<bool>,
    /// Why the connection is unusable, once a rollback failed.
    broken: RefCell<Option<String>>,
}

struct Connection {
    client: Client,
    statements: HashMap<(Rel, Op), Statement>,
}

impl Connection {
    fn statement(&mut self, rel: Rel, op: Op) -> Result<Statement> {
        if let Some(statement) = self.statements.get(&(rel, op)) {
            return Ok(statement.clone());
        }
        let statement = self
            .client
            .prepare(&op.sql(table(rel)))
            .map_err(|e| db_error(e, || format!("preparing {op:?} on {}", rel.name())))?;
        self.statements.insert((rel, op), statement.clone());
        Ok(statement)
    }
}

impl Engine for PgEngine {
    type Txn<'a> = PgTxn<'a>;

    /// Opens a REPEATABLE READ transaction. `after` needs nothing: the snapshot is
    /// taken at the transaction's first statement, after every commit that returned.
    async fn begin(&self, _after: u64) -> Result<PgTxn<'_>> {
        if let Some(why) = self.broken.borrow().as_ref() {
            return Err(Error::System(format!(
                "this PostgreSQL connection is unusable: {why}"
            )));
        }
        if self.open.get() {
            return Err(Error::System(
                "this engine already has an open transaction: a PostgreSQL engine has one \
                 connection and runs one transaction at a time"
                    .into(),
            ));
        }
        self.conn
            .borrow_mut()
            .client
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            .map_err(|e| db_error(e, || "beginning a transaction".to_string()))?;
        self.open.set(true);
        Ok(PgTxn {
            engine: self,
            failed: None,
            finished: false,
        })
    }

    async fn commit<'a>(&'a self, mut txn: PgTxn<'a>) -> Result<Committed> {
        if let Some(e) = txn.failed.take() {
            // PostgreSQL answers COMMIT in a failed transaction with a rollback, not an
            // error; the transaction's own failure is the answer. Dropping rolls back.
            return Err(e);
        }
        txn.finished = true;
        self.conn
            .borrow_mut()
            .client
            .batch_execute("COMMIT")
            .map_err(|e| db_error(e, || "committing".to_string()))?;
        Ok(Committed { cid: None })
    }

    fn abort<'a>(&'a self, txn: PgTxn<'a>) {
        drop(txn);
    }

    /// Runs the clients one after another: each holds the connection while it runs.
    fn run_clients<'a, T>(
        &'a self,
        clients: usize,
        make: impl FnMut(usize) -> ClientFuture<'a, T>,
    ) -> Vec<T> {
        crate::system::run_clients_in_turn(clients, make)
    }
}

/// A REPEATABLE READ transaction on its engine's connection.
pub struct PgTxn<'a> {
    engine: &'a PgEngine,
    /// The error of the statement that failed; PostgreSQL refuses every statement
    /// after it, and the transaction can only roll back.
    failed: Option<Error>,
    /// Committed (or its COMMIT failed): nothing to roll back.
    finished: bool,
}

impl PgTxn<'_> {
    /// Runs `statement` of `op` on `rel`, recording a failure for the rest of the
    /// transaction.
    fn run<T>(
        &mut self,
        rel: Rel,
        op: Op,
        statement: impl FnOnce(&mut Client, &Statement) -> Result<T, postgres::Error>,
    ) -> Result<T> {
        if let Some(e) = &self.failed {
            return Err(again(e));
        }
        let mut conn = self.engine.conn.borrow_mut();
        let prepared = conn.statement(rel, op);
        let outcome = prepared.and_then(|prepared| {
            statement(&mut conn.client, &prepared)
                .map_err(|e| db_error(e, || format!("running {op:?} on {}", rel.name())))
        });
        if let Err(e) = &outcome {
            self.failed = Some(again(e));
        }
        outcome
    }
}

/// The error `e` again, for a transaction that already failed with it.
fn again(e: &Error) -> Error {
    match e {
        Error::Aborted { reason, message } => Error::aborted(*reason, message.clone()),
        Error::Data(message) => Error::Data(message.clone()),
        Error::System(message) => Error::System(message.clone()),
        Error::Unknown { message, commit } => Error::Unknown {
            message: message.clone(),
            commit: *commit,
        },
    }
}

fn key_param(rel: Rel, key: u64) -> Result<i64> {
    key.into_sql()
        .map_err(|e| Error::Data(format!("{} key: {e}", rel.name())))
}

impl Drop for PgTxn<'_> {
    fn drop(&mut self) {
        if !self.finished
            && let Err(e) = self
                .engine
                .conn
                .borrow_mut()
                .client
                .batch_execute("ROLLBACK")
        {
            *self.engine.broken.borrow_mut() =
                Some(format!("rolling back failed: {}", error_text(&e)));
        }
        self.engine.open.set(false);
    }
}

impl Session for PgTxn<'_> {
    async fn get(&mut self, rel: Rel, key: u64) -> Result<Option<Vec<u8>>> {
        let key = key_param(rel, key)?;
        let row = self.run(rel, Op::Get, |client, statement| {
            client.query_opt(statement, &[&key])
        })?;
        row.map(|row| (table(rel).row)(&row)).transpose()
    }

    async fn get_many(&mut self, rel: Rel, keys: &[u64]) -> Result<Vec<Option<Vec<u8>>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let wanted = keys
            .iter()
            .map(|&key| key_param(rel, key))
            .collect::<Result<Vec<i64>>>()?;
        let rows = self.run(rel, Op::GetMany, |client, statement| {
            client.query(statement, &[&wanted])
        })?;
        let mut found = HashMap::with_capacity(rows.len());
        for row in &rows {
            let key: i64 = row
                .try_get(0)
                .map_err(|e| Error::Data(format!("{} key: {}", rel.name(), error_text(&e))))?;
            found.insert(key, (table(rel).row)(row)?);
        }
        Ok(wanted.iter().map(|key| found.get(key).cloned()).collect())
    }

    async fn put(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()> {
        let values = (table(rel).params)(key, &row)?;
        self.run(rel, Op::Upsert, |client, statement| {
            client.execute(statement, &param_refs(&values))
        })?;
        Ok(())
    }

    async fn insert(&mut self, rel: Rel, key: u64, row: Vec<u8>) -> Result<()> {
        let values = (table(rel).params)(key, &row)?;
        self.run(rel, Op::Insert, |client, statement| {
            client.execute(statement, &param_refs(&values))
        })?;
        Ok(())
    }

    async fn delete(&mut self, rel: Rel, key: u64) -> Result<()> {
        let key = key_param(rel, key)?;
        self.run(rel, Op::Delete, |client, statement| {
            client.execute(statement, &[&key])
        })?;
        Ok(())
    }
}

// ----------------------------------------------------------------- local server

/// A server started through `scripts/postgres.sh`; dropping it stops the server (and
/// deletes its directory if it was a scratch one).
pub struct LocalServer {
    script: PathBuf,
    dir: PathBuf,
    remove_dir: bool,
    conn_str: String,
}

impl LocalServer {
    fn start(script: &Script, dir: &Path, remove_dir: bool) -> Result<(Postgres, LocalServer)> {
        let (mut command, script) = script
            .command(dir)
            .map_err(|e| Error::System(e.to_string()))?;
        let script = script.as_path();
        let output = command
            .arg("start")
            .arg(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| Error::System(format!("cannot run {}: {e}", script.display())))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let conn_str = stdout.lines().rev().find(|line| !line.trim().is_empty());
        let conn_str = match (output.status.success(), conn_str) {
            (true, Some(line)) => line.trim().to_string(),
            _ => {
                if remove_dir {
                    // Nothing of a failed scratch server is worth keeping but its log,
                    // which the script has shown.
                    let _ = std::fs::remove_dir_all(dir);
                }
                return Err(Error::System(format!(
                    "{} start {} failed ({}):\n{}",
                    script.display(),
                    dir.display(),
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim_end()
                )));
            }
        };
        let server = LocalServer {
            script: script.to_path_buf(),
            dir: dir.to_path_buf(),
            remove_dir,
            conn_str,
        };
        server.watch()?;
        let postgres = Postgres::connect(&server.conn_str)?;
        Ok((postgres, server))
    }

    /// Starts the script's watcher, which stops the server once this process exits,
    /// so that a runner killed before dropping the guard leaves no server behind. It
    /// runs in its own process group, out of reach of a Ctrl-C meant for this one.
    fn watch(&self) -> Result<()> {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new("bash");
        command
            .arg(&self.script)
            .arg("watch")
            .arg(&self.dir)
            .arg(std::process::id().to_string());
        if self.remove_dir {
            command.arg("--remove");
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| Error::System(format!("cannot run {}: {e}", self.script.display())))?;
        Ok(())
    }

    /// `host=127.0.0.1 port=… user=namdb dbname=tpcw`.
    pub fn connection_string(&self) -> &str {
        &self.conn_str
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        let stopped = Command::new("bash")
            .arg(&self.script)
            .arg("stop")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .output();
        match stopped {
            Ok(output) if output.status.success() => {
                if self.remove_dir
                    && let Err(e) = std::fs::remove_dir_all(&self.dir)
                {
                    eprintln!("cannot delete {}: {e}", self.dir.display());
                }
            }
            // A guard cannot return an error; the watcher tries again when this
            // process exits.
            Ok(output) => eprintln!(
                "stopping PostgreSQL in {} failed:\n{}",
                self.dir.display(),
                String::from_utf8_lossy(&output.stderr).trim_end()
            ),
            Err(e) => eprintln!("cannot run {}: {e}", self.script.display()),
        }
    }
}
