//! The interactions' data-layer work (TPC-W clause 2), each one transaction written
//! against [`Session`], and the mixes that choose among them.
//!
//! - **Checkout** is the paper's transaction (§4.3): read three products, create one
//!   order and three order lines, update the three stocks (with Buy Confirm's stock
//!   rule, so stock never runs out).
//! - The others follow the specification's database work. Departures, all because this
//!   store has keyed access only: Search Results searches by subject (title and author
//!   searches need text indexes); New Products reads our per-subject index of the
//!   newest items ([`Rel::NewProducts`]); "the 3333 most recent orders" (Best Sellers,
//!   Admin Confirm's related items) are the latest orders of every client's id stream
//!   (see [`crate::schema::stream_id`]) plus, while those are few, the newest generated
//!   ones; Best Sellers results are cached for 30 s, as clause 6.3.3.1 allows.
//! - A client is one emulated browser with its own customer, cart and id streams.
//!   The mix picks each interaction independently with the specification's
//!   frequencies; Buy Confirm with an empty cart first fills it with one to three items.

use crate::generate::{self, a_string};
use crate::schema::*;
use crate::system::{Error, Result, Session};
use rand::Rng;
use rand::rngs::SmallRng;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

type BestSellerLists = Arc<Vec<Vec<(u64, u64)>>>;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Interaction {
    Checkout,
    Home,
    NewProducts,
    BestSellers,
    ProductDetail,
    SearchRequest,
    SearchResults,
    ShoppingCart,
    CustomerRegistration,
    BuyRequest,
    BuyConfirm,
    OrderInquiry,
    OrderDisplay,
    AdminRequest,
    AdminConfirm,
}

impl Interaction {
    pub const ALL: [Interaction; 15] = [
        Interaction::Checkout,
        Interaction::Home,
        Interaction::NewProducts,
        Interaction::BestSellers,
        Interaction::ProductDetail,
        Interaction::SearchRequest,
        Interaction::SearchResults,
        Interaction::ShoppingCart,
        Interaction::CustomerRegistration,
        Interaction::BuyRequest,
        Interaction::BuyConfirm,
        Interaction::OrderInquiry,
        Interaction::OrderDisplay,
        Interaction::AdminRequest,
        Interaction::AdminConfirm,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Interaction::Checkout => "checkout",
            Interaction::Home => "home",
            Interaction::NewProducts => "new_products",
            Interaction::BestSellers => "best_sellers",
            Interaction::ProductDetail => "product_detail",
            Interaction::SearchRequest => "search_request",
            Interaction::SearchResults => "search_results",
            Interaction::ShoppingCart => "shopping_cart",
            Interaction::CustomerRegistration => "customer_registration",
            Interaction::BuyRequest => "buy_request",
            Interaction::BuyConfirm => "buy_confirm",
            Interaction::OrderInquiry => "order_inquiry",
            Interaction::OrderDisplay => "order_display",
            Interaction::AdminRequest => "admin_request",
            Interaction::AdminConfirm => "admin_confirm",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Mix {
    /// Only the paper's checkout transaction.
    Checkout,
    /// WIPSb: 95% browsing, 5% ordering.
    Browsing,
    /// WIPS: 80% browsing, 20% ordering.
    Shopping,
    /// WIPSo: 50% browsing, 50% ordering.
    Ordering,
}

impl Mix {
    pub fn name(self) -> &'static str {
        match self {
            Mix::Checkout => "checkout",
            Mix::Browsing => "browsing",
            Mix::Shopping => "shopping",
            Mix::Ordering => "ordering",
        }
    }

    /// The frequencies (percent) of clause 5.2.4, Table 5.
    pub fn weights(self) -> Vec<(Interaction, f64)> {
        let percent: [f64; 14] = match self {
            Mix::Checkout => return vec![(Interaction::Checkout, 100.0)],
            Mix::Browsing => [
                29.00, 11.00, 11.00, 21.00, 12.00, 11.00, 2.00, 0.82, 0.75, 0.69, 0.30, 0.25, 0.10,
                0.09,
            ],
            Mix::Shopping => [
                16.00, 5.00, 5.00, 17.00, 20.00, 17.00, 11.60, 3.00, 2.60, 1.20, 0.75, 0.66, 0.10,
                0.09,
            ],
            Mix::Ordering => [
                9.12, 0.46, 0.46, 12.35, 14.53, 13.08, 13.53, 12.86, 12.73, 10.18, 0.25, 0.22,
                0.12, 0.11,
            ],
        };
        // ALL after Checkout is the specification's order of Table 5.
        Interaction::ALL[1..].iter().copied().zip(percent).collect()
    }

    pub fn picker(self) -> MixPicker {
        let weights = self.weights();
        let total: f64 = weights.iter().map(|w| w.1).sum();
        let mut acc = 0.0;
        MixPicker {
            cumulative: weights
                .into_iter()
                .map(|(i, w)| {
                    acc += w / total;
                    (acc, i)
                })
                .collect(),
        }
    }
}

pub struct MixPicker {
    cumulative: Vec<(f64, Interaction)>,
}

impl MixPicker {
    pub fn pick(&self, rng: &mut SmallRng) -> Interaction {
        let x: f64 = rng.random();
        self.cumulative
            .iter()
            .find(|(c, _)| x < *c)
            .unwrap_or(self.cumulative.last().expect("a mix has interactions"))
            .1
    }
}

/// What the run shares: the scale, the clients, and the Best Sellers cache.
pub struct Shared {
    pub scale: Scale,
    /// Client id streams in use: `0..streams`.
    pub streams: u64,
    /// Items whose id is a multiple of this are in the history sample (0: none).
    pub sample_every: u64,
    best_sellers: Mutex<BestSellersCache>,
}

/// The best-seller lists the clients share (clause 6.3.3.1 lets them be 30 s old).
///
/// Computing them reads every item sold in the recent orders: a long read, and ITEM
/// keeps one version, so it aborts with `SnapshotTooOld` whenever a checkout updates
/// one of those items meanwhile. When every client that found the lists stale
/// recomputed them, each attempt ran beside the others and took as much longer; with
/// 16 KiB items in a debug build no attempt ever finished before an update, and the
/// run never ended. So one client at a time recomputes, the others serve the lists it
/// replaces, and [`prime_best_sellers`] computes them before clients start.
#[derive(Default)]
struct BestSellersCache {
    lists: Option<(Instant, BestSellerLists)>,
    refreshing: bool,
}

/// What a Best Sellers client does about the lists ([`BestSellersCache::claim`]).
enum Claim<'a> {
    /// Serve these.
    Serve(BestSellerLists),
    /// Compute them and store them; `Some` when it is this client's turn to refresh.
    Compute(Option<RefreshTurn<'a>>),
}

impl BestSellersCache {
    /// Fresh lists are served; stale ones too while another client refreshes them;
    /// otherwise this client takes the turn to refresh. Lists that do not exist yet
    /// (nothing primed them) every client computes.
    fn claim<'a>(cache: &'a Mutex<BestSellersCache>, max_age: Duration) -> Claim<'a> {
        let mut me = cache.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = matches!(&me.lists, Some((at, _)) if at.elapsed() < max_age);
        match &me.lists {
            Some((_, lists)) if fresh || me.refreshing => Claim::Serve(lists.clone()),
            None if me.refreshing => Claim::Compute(None),
            _ => {
                me.refreshing = true;
                Claim::Compute(Some(RefreshTurn(cache)))
            }
        }
    }

    fn store(cache: &Mutex<BestSellersCache>, lists: BestSellerLists) {
        cache.lock().unwrap_or_else(|e| e.into_inner()).lists = Some((Instant::now(), lists));
    }
}

/// Clears [`BestSellersCache::refreshing`] when the refreshing client finishes, fails
/// or is dropped.
struct RefreshTurn<'a>(&'a Mutex<BestSellersCache>);

impl Drop for RefreshTurn<'_> {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).refreshing = false;
    }
}

impl Shared {
    /// The version of an item row the transaction read, if the item is sampled.
    async fn sampled_version<S: Session>(&self, s: &mut S, item: u64) -> Result<Option<u64>> {
        if self.sample_every != 0 && item.is_multiple_of(self.sample_every) {
            s.version(Rel::Item, item).await
        } else {
            Ok(None)
        }
    }
}

/// Best Sellers results may be this old (clause 6.3.3.1).
const BEST_SELLERS_CACHE: Duration = Duration::from_secs(30);
/// "The 3333 most recent orders" (clause 2.4.3).
const RECENT_ORDERS: u64 = 3333;

impl Shared {
    pub fn new(scale: Scale, streams: u64, sample_every: u64) -> Shared {
        Shared {
            scale,
            streams,
            sample_every,
            best_sellers: Mutex::new(BestSellersCache::default()),
        }
    }
}

/// One emulated browser.
pub struct Client {
    /// Its id stream (see [`stream_id`]).
    pub stream: u64,
    pub customer: u64,
    pub cart: Option<u64>,
    /// Next sequence numbers of its orders, customers, addresses and carts.
    pub next_order: u64,
    pub next_customer: u64,
    pub next_address: u64,
    pub next_cart: u64,
    /// Its last commit (its next transaction's snapshot includes it).
    pub last_commit: u64,
    pub rng: SmallRng,
}

impl Client {
    pub fn new(stream: u64, scale: &Scale, mut rng: SmallRng) -> Client {
        Client {
            stream,
            customer: rng.random_range(1..=scale.customers()),
            cart: None,
            next_order: 0,
            next_customer: 0,
            next_address: 0,
            next_cart: 0,
            last_commit: 0,
            rng,
        }
    }

    /// Applies what a committed transaction consumed and changed.
    pub fn committed(&mut self, effects: &Effects) {
        self.next_order += effects.orders as u64;
        self.next_customer += effects.customers as u64;
        self.next_address += effects.addresses as u64;
        self.next_cart += effects.carts as u64;
        if let Some(c) = effects.customer {
            self.customer = c;
        }
        if let Some(cart) = effects.cart {
            self.cart = cart;
        }
    }
}

/// A stock change: `qty` sold of `item`, whose stock went from `before` to `after`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sale {
    pub item: u64,
    pub qty: i32,
    pub before: i32,
    pub after: i32,
    pub restocked: bool,
    /// The version of the item row read, for sampled items on systems with versions.
    pub version: Option<u64>,
}

/// What one attempt of an interaction did, applied to the client and the run's
/// tallies only if it commits.
#[derive(Clone, Debug, Default)]
pub struct Effects {
    pub sales: Vec<Sale>,
    /// Orders made (each takes the next id of the client's order stream).
    pub orders: u32,
    pub customers: u32,
    pub addresses: u32,
    pub carts: u32,
    /// The client's customer from now on.
    pub customer: Option<u64>,
    /// The client's cart from now on (`Some(None)`: none).
    pub cart: Option<Option<u64>>,
    /// Stocks read without a sale, with their versions (sampled items only).
    pub stock_reads: Vec<(u64, i32, Option<u64>)>,
    /// Items whose row was rewritten with its stock unchanged (Admin Confirm), as
    /// (item, stock, version read): a new version of the stock all the same.
    pub stock_rewrites: Vec<(u64, i32, Option<u64>)>,
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(generate::NOW)
}

fn missing(rel: Rel, key: u64) -> Error {
    Error::Data(format!("{} row {key} is missing", rel.name()))
}

async fn must_get<S: Session>(s: &mut S, rel: Rel, key: u64) -> Result<Vec<u8>> {
    s.get(rel, key).await?.ok_or_else(|| missing(rel, key))
}

fn random_item(client: &mut Client, scale: &Scale) -> u64 {
    client.rng.random_range(1..=scale.items)
}

/// `n` distinct random items.
fn distinct_items(client: &mut Client, scale: &Scale, n: usize) -> Vec<u64> {
    let mut items = Vec::with_capacity(n);
    while items.len() < n {
        let i = random_item(client, scale);
        if !items.contains(&i) {
            items.push(i);
        }
    }
    items
}

/// Runs `interaction`'s reads and writes in `s` (the caller begins and commits).
pub async fn run<S: Session>(
    interaction: Interaction,
    s: &mut S,
    client: &mut Client,
    shared: &Shared,
) -> Result<Effects> {
    let mut fx = Effects::default();
    match interaction {
        Interaction::Checkout => checkout(s, client, shared, &mut fx).await?,
        Interaction::Home => home(s, client, shared).await?,
        Interaction::NewProducts => new_products(s, client).await?,
        Interaction::BestSellers => best_sellers(s, client, shared).await?,
        Interaction::ProductDetail => product_detail(s, client, shared, &mut fx).await?,
        Interaction::SearchRequest => promotional(s, client, shared).await?,
        Interaction::SearchResults => search_results(s, client).await?,
        Interaction::ShoppingCart => shopping_cart(s, client, shared, &mut fx).await?,
        Interaction::CustomerRegistration => customer_registration(s, client).await?,
        Interaction::BuyRequest => buy_request(s, client, shared, &mut fx).await?,
        Interaction::BuyConfirm => buy_confirm(s, client, shared, &mut fx).await?,
        Interaction::OrderInquiry => {
            must_get(s, Rel::Customer, client.customer).await?;
        }
        Interaction::OrderDisplay => order_display(s, client).await?,
        Interaction::AdminRequest => admin_request(s, client, shared).await?,
        Interaction::AdminConfirm => admin_confirm(s, client, shared, &mut fx).await?,
    }
    Ok(fx)
}

/// The paper's checkout: three products read, one order and three order lines
/// created, three stocks updated.
async fn checkout<S: Session>(
    s: &mut S,
    client: &mut Client,
    shared: &Shared,
    fx: &mut Effects,
) -> Result<()> {
    let items = distinct_items(client, &shared.scale, 3);
    let rows = s.get_many(Rel::Item, &items).await?;
    let o_id = stream_id(client.stream, client.next_order);
    let mut sub_total = 0i64;
    for (line, (row, &i_id)) in rows.into_iter().zip(&items).enumerate() {
        let mut row = row.ok_or_else(|| missing(Rel::Item, i_id))?;
        let qty = client.rng.random_range(1..=5);
        let before = Item::stock_of(&row)?;
        let (after, restocked) = sell(before, qty);
        Item::set_stock(&mut row, after)?;
        sub_total += Item::cost_of(&row)? * qty as i64;
        s.put(Rel::Item, i_id, row).await?;
        let ol = OrderLine {
            ol_id: line as u64,
            ol_o_id: o_id,
            ol_i_id: i_id,
            ol_qty: qty as u32,
            ol_discount: 0,
            ol_comments: String::new(),
        };
        s.insert(
            Rel::OrderLine,
            order_line_key(o_id, line as u64),
            ol.encode(),
        )
        .await?;
        fx.sales.push(Sale {
            item: i_id,
            qty,
            before,
            after,
            restocked,
            version: shared.sampled_version(s, i_id).await?,
        });
    }
    let date = now();
    let tax = sub_total * 825 / 10_000;
    let order = Order {
        o_id,
        o_c_id: client.customer,
        o_date: date,
        o_sub_total: sub_total,
        o_tax: tax,
        o_total: sub_total + tax,
        o_ship_type: "AIR".into(),
        o_ship_date: date,
        o_bill_addr_id: 0,
        o_ship_addr_id: 0,
        o_status: "PENDING".into(),
        o_num_lines: 3,
    };
    s.insert(Rel::Orders, o_id, order.encode()).await?;
    fx.orders = 1;
    Ok(())
}

/// Promotional processing (clause 2.3.3, also on Search Request and others): the
/// related items of a random item, with their thumbnails.
async fn promotional<S: Session>(s: &mut S, client: &mut Client, shared: &Shared) -> Result<()> {
    let i_id = random_item(client, &shared.scale);
    let item = Item::decode(&must_get(s, Rel::Item, i_id).await?)?;
    let related = s.get_many(Rel::Item, &item.related()).await?;
    for (row, id) in related.into_iter().zip(item.related()) {
        let row = row.ok_or_else(|| missing(Rel::Item, id))?;
        Item::decode(&row)?;
    }
    Ok(())
}

async fn home<S: Session>(s: &mut S, client: &mut Client, shared: &Shared) -> Result<()> {
    if client.customer != 0 {
        Customer::decode(&must_get(s, Rel::Customer, client.customer).await?)?;
    }
    promotional(s, client, shared).await
}

/// Items and their authors, decoded.
async fn items_with_authors<S: Session>(s: &mut S, ids: &[u64]) -> Result<Vec<(Item, Author)>> {
    let rows = s.get_many(Rel::Item, ids).await?;
    let mut items = Vec::with_capacity(ids.len());
    for (row, &id) in rows.into_iter().zip(ids) {
        items.push(Item::decode(&row.ok_or_else(|| missing(Rel::Item, id))?)?);
    }
    let author_ids: Vec<u64> = items.iter().map(|i| i.i_a_id).collect();
    let authors = s.get_many(Rel::Author, &author_ids).await?;
    let mut out = Vec::with_capacity(items.len());
    for ((row, id), item) in authors.into_iter().zip(author_ids).zip(items) {
        out.push((
            item,
            Author::decode(&row.ok_or_else(|| missing(Rel::Author, id))?)?,
        ));
    }
    Ok(out)
}

async fn subject_newest<S: Session>(s: &mut S, subject: u64) -> Result<NewProducts> {
    Ok(NewProducts::decode(
        &must_get(s, Rel::NewProducts, subject).await?,
    )?)
}

async fn new_products<S: Session>(s: &mut S, client: &mut Client) -> Result<()> {
    let subject = client.rng.random_range(0..SUBJECTS.len() as u64);
    let newest = subject_newest(s, subject).await?;
    let ids: Vec<u64> = newest.items.iter().map(|&(_, id)| id).collect();
    let listed = items_with_authors(s, &ids).await?;
    for ((date, _), (item, _)) in newest.items.iter().zip(&listed) {
        if item.i_pub_date != *date || item.i_subject != SUBJECTS[subject as usize] {
            return Err(Error::Data(format!(
                "new_products lists item {} under {} at {date}, the item says {} at {}",
                item.i_id, SUBJECTS[subject as usize], item.i_subject, item.i_pub_date
            )));
        }
    }
    Ok(())
}

/// Search by subject, ordered by title (clause 2.6.3, subject search).
async fn search_results<S: Session>(s: &mut S, client: &mut Client) -> Result<()> {
    let subject = client.rng.random_range(0..SUBJECTS.len() as u64);
    let newest = subject_newest(s, subject).await?;
    let ids: Vec<u64> = newest.items.iter().map(|&(_, id)| id).collect();
    let mut listed = items_with_authors(s, &ids).await?;
    listed.sort_by(|a, b| a.0.i_title.cmp(&b.0.i_title));
    Ok(())
}

async fn product_detail<S: Session>(
    s: &mut S,
    client: &mut Client,
    shared: &Shared,
    fx: &mut Effects,
) -> Result<()> {
    let i_id = random_item(client, &shared.scale);
    let (item, _) = items_with_authors(s, &[i_id])
        .await?
        .pop()
        .ok_or_else(|| missing(Rel::Item, i_id))?;
    let version = shared.sampled_version(s, i_id).await?;
    fx.stock_reads.push((i_id, item.i_stock, version));
    Ok(())
}

/// Each stream's count of orders at the snapshot. A stream's ids are dense from
/// sequence 0 (one client makes them in order), so an exponential then a binary search
/// finds its count; the probes of every stream at one step go in one batched read.
/// Searching the streams one after another took a round trip per probe: about
/// 2·log2(orders) per stream, over a thousand sequential reads with 64 clients, which
/// made Admin Confirm's median 150 ms on tcp.
async fn order_counts<S: Session>(s: &mut S, streams: u64) -> Result<Vec<u64>> {
    /// Orders exist at sequences `[0, lo)` and, once `absent_from` is known, at none
    /// from it on.
    #[derive(Clone, Copy)]
    struct Search {
        lo: u64,
        absent_from: Option<u64>,
    }
    let mut searches = vec![
        Search {
            lo: 0,
            absent_from: None
        };
        streams as usize
    ];
    loop {
        let probes: Vec<(usize, u64)> = searches
            .iter()
            .enumerate()
            .filter_map(|(stream, search)| match search.absent_from {
                // Sequences 0, 1, 3, 7, …: the count at least doubles while found.
                None => Some((stream, (search.lo * 2).saturating_sub(1))),
                Some(top) if search.lo < top => Some((stream, search.lo + (top - search.lo) / 2)),
                Some(_) => None,
            })
            .collect();
        if probes.is_empty() {
            return Ok(searches.iter().map(|search| search.lo).collect());
        }
        let keys: Vec<u64> = probes
            .iter()
            .map(|&(stream, seq)| stream_id(stream as u64, seq))
            .collect();
        let rows = s.get_many(Rel::Orders, &keys).await?;
        for ((stream, seq), row) in probes.into_iter().zip(rows) {
            let search = &mut searches[stream];
            if row.is_some() {
                search.lo = seq + 1;
            } else {
                search.absent_from = Some(seq);
            }
        }
    }
}

/// The orders of the latest "3333", as (order id, lines) — see the module's docs.
async fn recent_orders<S: Session>(s: &mut S, shared: &Shared) -> Result<Vec<Order>> {
    let counts = order_counts(s, shared.streams).await?;
    let made: u64 = counts.iter().sum();
    let mut keys = Vec::new();
    let active = counts.iter().filter(|&&c| c > 0).count() as u64;
    if active > 0 {
        let per_stream = RECENT_ORDERS.div_ceil(active);
        for (stream, &count) in counts.iter().enumerate() {
            for seq in count.saturating_sub(per_stream)..count {
                keys.push(stream_id(stream as u64, seq));
            }
        }
    }
    let generated = shared.scale.orders();
    let from_generated = RECENT_ORDERS.saturating_sub(made).min(generated);
    keys.extend((generated - from_generated + 1)..=generated);
    let rows = s.get_many(Rel::Orders, &keys).await?;
    let mut orders = Vec::with_capacity(keys.len());
    for (row, key) in rows.into_iter().zip(keys) {
        orders.push(Order::decode(
            &row.ok_or_else(|| missing(Rel::Orders, key))?,
        )?);
    }
    Ok(orders)
}

/// The order lines of `orders`.
async fn lines_of<S: Session>(s: &mut S, orders: &[Order]) -> Result<Vec<OrderLine>> {
    let keys: Vec<u64> = orders
        .iter()
        .flat_map(|o| (0..o.o_num_lines as u64).map(move |l| order_line_key(o.o_id, l)))
        .collect();
    let rows = s.get_many(Rel::OrderLine, &keys).await?;
    let mut lines = Vec::with_capacity(keys.len());
    for (row, key) in rows.into_iter().zip(keys) {
        lines.push(OrderLine::decode(
            &row.ok_or_else(|| missing(Rel::OrderLine, key))?,
        )?);
    }
    Ok(lines)
}

/// Best Sellers (clause 2.4): of the recent orders, the 50 items of a subject sold
/// most, with their authors. One pass computes every subject's list; the lists are
/// cached for 30 s.
async fn best_sellers<S: Session>(s: &mut S, client: &mut Client, shared: &Shared) -> Result<()> {
    let subject = client.rng.random_range(0..SUBJECTS.len());
    let lists = match BestSellersCache::claim(&shared.best_sellers, BEST_SELLERS_CACHE) {
        Claim::Serve(lists) => lists,
        Claim::Compute(turn) => {
            let lists = prime_best_sellers(s, shared).await?;
            drop(turn);
            lists
        }
    };
    let ids: Vec<u64> = lists[subject].iter().map(|t| t.0).collect();
    items_with_authors(s, &ids).await?;
    Ok(())
}

/// Computes the best-seller lists in `s` and stores them for the clients of `shared`
/// to serve (see [`BestSellersCache`]); the caller commits.
pub async fn prime_best_sellers<S: Session>(s: &mut S, shared: &Shared) -> Result<BestSellerLists> {
    let lists = Arc::new(best_seller_lists(s, shared).await?);
    BestSellersCache::store(&shared.best_sellers, lists.clone());
    Ok(lists)
}

/// Per subject, the 50 items sold most in the recent orders, as (item, quantity).
async fn best_seller_lists<S: Session>(s: &mut S, shared: &Shared) -> Result<Vec<Vec<(u64, u64)>>> {
    let orders = recent_orders(s, shared).await?;
    let lines = lines_of(s, &orders).await?;
    let mut sold: HashMap<u64, u64> = HashMap::new();
    for l in &lines {
        *sold.entry(l.ol_i_id).or_default() += l.ol_qty as u64;
    }
    let mut candidates: Vec<(u64, u64)> = sold.into_iter().collect();
    candidates.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let ids: Vec<u64> = candidates.iter().map(|c| c.0).collect();
    let rows = s.get_many(Rel::Item, &ids).await?;
    let mut lists = vec![Vec::new(); SUBJECTS.len()];
    for (row, &(id, qty)) in rows.into_iter().zip(&candidates) {
        let item = Item::decode(&row.ok_or_else(|| missing(Rel::Item, id))?)?;
        let subject = subject_index(&item.i_subject)
            .ok_or_else(|| Error::Data(format!("item {id} has subject {}", item.i_subject)))?;
        let list: &mut Vec<(u64, u64)> = &mut lists[subject as usize];
        if list.len() < 50 {
            list.push((id, qty));
        }
    }
    Ok(lists)
}

/// The client's cart and its lines (none if it has no cart).
async fn read_cart<S: Session>(
    s: &mut S,
    client: &Client,
) -> Result<Option<(ShoppingCart, Vec<ShoppingCartLine>)>> {
    let Some(sc_id) = client.cart else {
        return Ok(None);
    };
    let cart = ShoppingCart::decode(&must_get(s, Rel::ShoppingCart, sc_id).await?)?;
    let keys: Vec<u64> = (0..cart.sc_num_lines as u64)
        .map(|l| cart_line_key(sc_id, l))
        .collect();
    let rows = s.get_many(Rel::ShoppingCartLine, &keys).await?;
    let mut lines = Vec::with_capacity(keys.len());
    for (row, key) in rows.into_iter().zip(keys) {
        lines.push(ShoppingCartLine::decode(
            &row.ok_or_else(|| missing(Rel::ShoppingCartLine, key))?,
        )?);
    }
    Ok(Some((cart, lines)))
}

/// Shopping Cart (clause 2.5): create the cart if needed, add an item (or one more of
/// it), sometimes change a quantity, then show the cart with its items.
async fn shopping_cart<S: Session>(
    s: &mut S,
    client: &mut Client,
    shared: &Shared,
    fx: &mut Effects,
) -> Result<()> {
    let (mut cart, mut lines) = match read_cart(s, client).await? {
        Some(found) => found,
        None => {
            let sc_id = stream_id(client.stream, client.next_cart);
            fx.carts = 1;
            fx.cart = Some(Some(sc_id));
            let cart = ShoppingCart {
                sc_id,
                sc_time: now(),
                sc_num_lines: 0,
            };
            s.insert(Rel::ShoppingCart, sc_id, cart.encode()).await?;
            (cart, Vec::new())
        }
    };
    let add = random_item(client, &shared.scale);
    match lines.iter().position(|l| l.scl_i_id == add) {
        Some(at) => {
            lines[at].scl_qty += 1;
            let key = cart_line_key(cart.sc_id, at as u64);
            s.put(Rel::ShoppingCartLine, key, lines[at].encode())
                .await?;
        }
        None if (lines.len() as u64) < MAX_LINES => {
            let line = ShoppingCartLine {
                scl_sc_id: cart.sc_id,
                scl_qty: 1,
                scl_i_id: add,
            };
            let key = cart_line_key(cart.sc_id, lines.len() as u64);
            s.insert(Rel::ShoppingCartLine, key, line.encode()).await?;
            lines.push(line);
        }
        None => {}
    }
    // Clause 2.5.4: sometimes the browser changes quantities.
    if !lines.is_empty() && client.rng.random_bool(0.25) {
        let at = client.rng.random_range(0..lines.len());
        lines[at].scl_qty = client.rng.random_range(1..=10);
        let key = cart_line_key(cart.sc_id, at as u64);
        s.put(Rel::ShoppingCartLine, key, lines[at].encode())
            .await?;
    }
    cart.sc_time = now();
    cart.sc_num_lines = lines.len() as u32;
    s.put(Rel::ShoppingCart, cart.sc_id, cart.encode()).await?;
    let ids: Vec<u64> = lines.iter().map(|l| l.scl_i_id).collect();
    let rows = s.get_many(Rel::Item, &ids).await?;
    for (row, id) in rows.into_iter().zip(ids) {
        row.ok_or_else(|| missing(Rel::Item, id))?;
    }
    Ok(())
}

/// Customer Registration (clause 2.6): a returning customer is looked up by user name.
async fn customer_registration<S: Session>(s: &mut S, client: &mut Client) -> Result<()> {
    if client.customer != 0 {
        let c = Customer::decode(&must_get(s, Rel::Customer, client.customer).await?)?;
        if c.c_uname.is_empty() {
            return Err(Error::Data(format!("customer {} has no user name", c.c_id)));
        }
    }
    Ok(())
}

/// Buy Request (clause 2.7): a returning customer (80%) logs in again, a new one
/// (20%) registers with a new address; then the cart is priced.
async fn buy_request<S: Session>(
    s: &mut S,
    client: &mut Client,
    shared: &Shared,
    fx: &mut Effects,
) -> Result<()> {
    if client.rng.random_bool(0.8) {
        let mut c = Customer::decode(&must_get(s, Rel::Customer, client.customer).await?)?;
        c.c_login = now();
        c.c_expiration = c.c_login + 7200;
        s.put(Rel::Customer, c.c_id, c.encode()).await?;
        Address::decode(&must_get(s, Rel::Address, c.c_addr_id).await?)?;
    } else {
        let c_id = stream_id(client.stream, client.next_customer);
        let addr_id = stream_id(client.stream, client.next_address);
        let address = Address {
            addr_id,
            addr_co_id: client.rng.random_range(1..=shared.scale.countries()),
            ..generate::address(&shared.scale, client.rng.random_range(1..=1000))
        };
        s.insert(Rel::Address, addr_id, address.encode()).await?;
        let template = client.rng.random_range(1..=1000);
        let c = generate::registered_customer(&shared.scale, c_id, addr_id, template, now());
        s.insert(Rel::Customer, c_id, c.encode()).await?;
        fx.customers = 1;
        fx.addresses = 1;
        fx.customer = Some(c_id);
    }
    if let Some((_, lines)) = read_cart(s, client).await? {
        let ids: Vec<u64> = lines.iter().map(|l| l.scl_i_id).collect();
        let rows = s.get_many(Rel::Item, &ids).await?;
        for (row, id) in rows.into_iter().zip(ids) {
            Item::cost_of(&row.ok_or_else(|| missing(Rel::Item, id))?)?;
        }
    }
    Ok(())
}

/// Buy Confirm (clause 2.8): the cart becomes an order with its lines, each item's
/// stock follows the stock rule, the card is charged (CC_XACTS), the cart is emptied.
async fn buy_confirm<S: Session>(
    s: &mut S,
    client: &mut Client,
    shared: &Shared,
    fx: &mut Effects,
) -> Result<()> {
    let mut lines: Vec<(u64, u32)> = match read_cart(s, client).await? {
        Some((mut cart, lines)) => {
            for l in 0..cart.sc_num_lines as u64 {
                s.delete(Rel::ShoppingCartLine, cart_line_key(cart.sc_id, l))
                    .await?;
            }
            cart.sc_num_lines = 0;
            cart.sc_time = now();
            s.put(Rel::ShoppingCart, cart.sc_id, cart.encode()).await?;
            lines.iter().map(|l| (l.scl_i_id, l.scl_qty)).collect()
        }
        None => Vec::new(),
    };
    if lines.is_empty() {
        let n = client.rng.random_range(1..=3);
        for id in distinct_items(client, &shared.scale, n) {
            lines.push((id, client.rng.random_range(1..=5)));
        }
    }
    let mut customer = Customer::decode(&must_get(s, Rel::Customer, client.customer).await?)?;
    let ids: Vec<u64> = lines.iter().map(|l| l.0).collect();
    let rows = s.get_many(Rel::Item, &ids).await?;
    let o_id = stream_id(client.stream, client.next_order);
    let mut sub_total = 0i64;
    for (line, (row, &(i_id, qty))) in rows.into_iter().zip(&lines).enumerate() {
        let mut row = row.ok_or_else(|| missing(Rel::Item, i_id))?;
        let before = Item::stock_of(&row)?;
        let (after, restocked) = sell(before, qty as i32);
        Item::set_stock(&mut row, after)?;
        let cost = Item::cost_of(&row)? * qty as i64;
        sub_total += cost - cost * customer.c_discount as i64 / 100;
        s.put(Rel::Item, i_id, row).await?;
        let ol = OrderLine {
            ol_id: line as u64,
            ol_o_id: o_id,
            ol_i_id: i_id,
            ol_qty: qty,
            ol_discount: customer.c_discount,
            ol_comments: a_string(&mut client.rng, 20..=100),
        };
        s.insert(
            Rel::OrderLine,
            order_line_key(o_id, line as u64),
            ol.encode(),
        )
        .await?;
        fx.sales.push(Sale {
            item: i_id,
            qty: qty as i32,
            before,
            after,
            restocked,
            version: shared.sampled_version(s, i_id).await?,
        });
    }
    let date = now();
    let tax = sub_total * 825 / 10_000;
    let order = Order {
        o_id,
        o_c_id: customer.c_id,
        o_date: date,
        o_sub_total: sub_total,
        o_tax: tax,
        o_total: sub_total + tax + 300 + 100 * lines.len() as i64,
        o_ship_type: "UPS".into(),
        o_ship_date: date + client.rng.random_range(1..=7) * 86_400,
        o_bill_addr_id: customer.c_addr_id,
        o_ship_addr_id: customer.c_addr_id,
        o_status: "PENDING".into(),
        o_num_lines: lines.len() as u32,
    };
    s.insert(Rel::Orders, o_id, order.encode()).await?;
    let address = Address::decode(&must_get(s, Rel::Address, customer.c_addr_id).await?)?;
    let cc = generate::cc_xact(&mut client.rng, &order, address.addr_co_id);
    s.insert(Rel::CcXacts, o_id, cc.encode()).await?;
    customer.c_last_o_id = o_id;
    customer.c_balance += order.o_total;
    s.put(Rel::Customer, customer.c_id, customer.encode())
        .await?;
    fx.orders = 1;
    Ok(())
}

/// Order Display (clause 2.9): the customer's latest order, its lines with their items,
/// its payment and addresses.
async fn order_display<S: Session>(s: &mut S, client: &mut Client) -> Result<()> {
    let c = Customer::decode(&must_get(s, Rel::Customer, client.customer).await?)?;
    if c.c_last_o_id == 0 {
        return Ok(());
    }
    let order = Order::decode(&must_get(s, Rel::Orders, c.c_last_o_id).await?)?;
    let lines = lines_of(s, std::slice::from_ref(&order)).await?;
    let ids: Vec<u64> = lines.iter().map(|l| l.ol_i_id).collect();
    items_with_authors(s, &ids).await?;
    CcXact::decode(&must_get(s, Rel::CcXacts, order.o_id).await?)?;
    let addrs = [order.o_bill_addr_id, order.o_ship_addr_id];
    for (row, id) in s
        .get_many(Rel::Address, &addrs)
        .await?
        .into_iter()
        .zip(addrs)
    {
        Address::decode(&row.ok_or_else(|| missing(Rel::Address, id))?)?;
    }
    Ok(())
}

async fn admin_request<S: Session>(s: &mut S, client: &mut Client, shared: &Shared) -> Result<()> {
    let i_id = random_item(client, &shared.scale);
    items_with_authors(s, &[i_id]).await?;
    Ok(())
}

/// Admin Confirm (clause 2.16): new cost, image and publication date for an item, and
/// its related items recomputed from what recent buyers of it also bought.
async fn admin_confirm<S: Session>(
    s: &mut S,
    client: &mut Client,
    shared: &Shared,
    fx: &mut Effects,
) -> Result<()> {
    let i_id = random_item(client, &shared.scale);
    let mut item = Item::decode(&must_get(s, Rel::Item, i_id).await?)?;
    let version = shared.sampled_version(s, i_id).await?;
    let orders = recent_orders(s, shared).await?;
    let lines = lines_of(s, &orders).await?;
    let mut buyers_orders = std::collections::HashSet::new();
    for l in &lines {
        if l.ol_i_id == i_id {
            buyers_orders.insert(l.ol_o_id);
        }
    }
    let mut together: HashMap<u64, u64> = HashMap::new();
    for l in &lines {
        if buyers_orders.contains(&l.ol_o_id) && l.ol_i_id != i_id {
            *together.entry(l.ol_i_id).or_default() += l.ol_qty as u64;
        }
    }
    let mut ranked: Vec<(u64, u64)> = together.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut related: Vec<u64> = ranked.into_iter().map(|r| r.0).take(5).collect();
    // Fewer than five bought together: keep the old ones to fill up.
    for old in item.related() {
        if related.len() < 5 && !related.contains(&old) && old != i_id {
            related.push(old);
        }
    }
    [
        item.i_related1,
        item.i_related2,
        item.i_related3,
        item.i_related4,
        item.i_related5,
    ] = [related[0], related[1], related[2], related[3], related[4]];
    item.i_cost = (item.i_srp * client.rng.random_range(50..=100) / 100).max(1);
    item.i_image = format!("img{}/image_{}_{}.gif", i_id % 100, i_id, client.stream);
    item.i_thumbnail = format!("img{}/thumb_{}_{}.gif", i_id % 100, i_id, client.stream);
    item.i_pub_date = now().max(item.i_pub_date + 1);
    // The row keeps its size (ITEM's blocks are sized for it): the description gives
    // back what the longer image names took.
    let grown = item
        .encode()
        .len()
        .saturating_sub(shared.scale.item_bytes as usize);
    let keep = item.i_desc.len().saturating_sub(grown);
    item.i_desc.truncate(keep);
    let subject = subject_index(&item.i_subject)
        .ok_or_else(|| Error::Data(format!("item {i_id} has subject {}", item.i_subject)))?;
    let mut newest = subject_newest(s, subject).await?;
    newest.publish(item.i_pub_date, i_id);
    s.put(Rel::NewProducts, subject, newest.encode()).await?;
    s.put(Rel::Item, i_id, item.encode()).await?;
    fx.stock_rewrites.push((i_id, item.i_stock, version));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// ORDERS rows by key alone (empty rows), counting the reads.
    struct OrdersOnly {
        keys: std::collections::HashSet<u64>,
        batched_reads: usize,
        single_reads: usize,
    }

    impl Session for OrdersOnly {
        async fn get(&mut self, rel: Rel, key: u64) -> Result<Option<Vec<u8>>> {
            self.single_reads += 1;
            Ok(self.get_many(rel, &[key]).await?.pop().flatten())
        }
        async fn get_many(&mut self, rel: Rel, keys: &[u64]) -> Result<Vec<Option<Vec<u8>>>> {
            assert!(matches!(rel, Rel::Orders));
            self.batched_reads += 1;
            Ok(keys
                .iter()
                .map(|k| self.keys.contains(k).then(Vec::new))
                .collect())
        }
        async fn put(&mut self, _: Rel, _: u64, _: Vec<u8>) -> Result<()> {
            Err(Error::Data("read-only".into()))
        }
        async fn insert(&mut self, _: Rel, _: u64, _: Vec<u8>) -> Result<()> {
            Err(Error::Data("read-only".into()))
        }
        async fn delete(&mut self, _: Rel, _: u64) -> Result<()> {
            Err(Error::Data("read-only".into()))
        }
    }

    /// Every stream's count is found exactly, in one batched read per search step of
    /// the longest stream (an exponential then a binary search: at most
    /// 2·⌈log2(count + 1)⌉ + 1), not a read per probe per stream (over 100 here).
    #[test]
    fn every_streams_order_count_is_found_in_a_few_batched_reads() {
        let counts = [0u64, 1, 2, 3, 5, 8, 700, 1024, 1025, 0, 64, 4];
        let keys = counts
            .iter()
            .enumerate()
            .flat_map(|(stream, &count)| (0..count).map(move |seq| stream_id(stream as u64, seq)))
            .collect();
        let mut orders = OrdersOnly {
            keys,
            batched_reads: 0,
            single_reads: 0,
        };
        let found = txn::runtime::block_on(order_counts(&mut orders, counts.len() as u64)).unwrap();
        assert_eq!(found, counts);
        assert_eq!(orders.single_reads, 0);
        assert!(
            orders.batched_reads <= 2 * 11 + 1,
            "{} reads",
            orders.batched_reads
        );
        // No streams, no reads.
        orders.batched_reads = 0;
        assert!(
            txn::runtime::block_on(order_counts(&mut orders, 0))
                .unwrap()
                .is_empty()
        );
        assert_eq!(orders.batched_reads, 0);
    }

    #[test]
    fn one_client_at_a_time_refreshes_stale_best_sellers_and_the_others_serve_them() {
        let cache = Mutex::new(BestSellersCache::default());
        let lists = |item| Arc::new(vec![vec![(item, 1)]]);
        // No lists yet (nothing primed them): the first client takes the turn, and
        // the others, with nothing to serve, compute them too.
        let Claim::Compute(Some(turn)) = BestSellersCache::claim(&cache, Duration::from_secs(30))
        else {
            panic!("the first client computes the lists");
        };
        assert!(matches!(
            BestSellersCache::claim(&cache, Duration::from_secs(30)),
            Claim::Compute(None)
        ));
        BestSellersCache::store(&cache, lists(7));
        drop(turn);
        let served = |claim: Claim| match claim {
            Claim::Serve(l) => l[0][0].0,
            Claim::Compute(_) => panic!("computed, not served"),
        };
        assert_eq!(
            served(BestSellersCache::claim(&cache, Duration::from_secs(30))),
            7
        );
        // Stale: the first client takes the turn, the next serve the stale lists.
        let Claim::Compute(Some(turn)) = BestSellersCache::claim(&cache, Duration::ZERO) else {
            panic!("the first client finding the lists stale refreshes them");
        };
        for _ in 0..3 {
            assert_eq!(served(BestSellersCache::claim(&cache, Duration::ZERO)), 7);
        }
        // The refresh failed (its turn dropped): the next client takes it.
        drop(turn);
        let Claim::Compute(Some(turn)) = BestSellersCache::claim(&cache, Duration::ZERO) else {
            panic!("a failed refresh gives the turn to the next client");
        };
        BestSellersCache::store(&cache, lists(9));
        drop(turn);
        assert_eq!(
            served(BestSellersCache::claim(&cache, Duration::from_secs(30))),
            9
        );
    }

    #[test]
    fn mixes_follow_the_specification_frequencies() {
        for mix in [Mix::Browsing, Mix::Shopping, Mix::Ordering] {
            let w = mix.weights();
            let total: f64 = w.iter().map(|x| x.1).sum();
            assert!((total - 100.0).abs() < 0.01, "{mix:?} sums to {total}");
            assert!(w.iter().all(|x| x.0 != Interaction::Checkout));
        }
        let share = |mix: Mix, i: Interaction| mix.weights().iter().find(|w| w.0 == i).unwrap().1;
        assert_eq!(share(Mix::Ordering, Interaction::BuyConfirm), 10.18);
        assert_eq!(share(Mix::Browsing, Interaction::Home), 29.0);
        assert_eq!(share(Mix::Shopping, Interaction::ShoppingCart), 11.6);
        // The picker draws at those frequencies.
        let picker = Mix::Shopping.picker();
        let mut rng = SmallRng::seed_from_u64(1);
        let n = 200_000;
        let carts = (0..n)
            .filter(|_| picker.pick(&mut rng) == Interaction::ShoppingCart)
            .count();
        assert!((carts as f64 / n as f64 - 0.116).abs() < 0.005, "{carts}");
        assert_eq!(Mix::Checkout.picker().pick(&mut rng), Interaction::Checkout);
    }
}
