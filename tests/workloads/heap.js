// A Node.js job for the soak: imitates a long-running Node service or build/ETL script that keeps a
// growing in-memory model (a cache of parsed JSON-like objects, an index of typed-array embeddings)
// and hands CPU-heavy parts to worker_threads - so V8's heap grows step by step, its young generation
// fills with garbage every step, and a part of the old generation is dropped now and then.
//
//     node tests/workloads/heap.js --seed 7 --steps 120 --step-seconds 0.08 [--workers 2]
//
// (--workers 0: no worker threads, everything on the main thread.)
//
// Each step the main thread does its share and asks every worker for theirs, then awaits the answers
// in worker order, so the output does not depend on scheduling. Every thread has its own seeded PRNG
// (mulberry32) carried from step to step, and each step reads back objects and arrays kept in earlier
// steps: the digest depends only on the arguments, and a restored run prints the same one as an
// uninterrupted run only if the heap came back intact. Prints "start-up: ..." once, "step N/M" per
// step, then "done digest=<hex>".
"use strict";

const crypto = require("crypto");
const { Worker, isMainThread, parentPort, workerData } = require("worker_threads");

const DROP_EVERY = 30; // steps: then about half of what was kept is dropped

// mulberry32: the same sequence for the same seed, on every run
function rng(seed) {
  let a = seed >>> 0;
  const next = () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return (t ^ (t >>> 14)) >>> 0;
  };
  next.below = (n) => next() % n;
  return next;
}

// One thread's state, kept from step to step, and its step.
function shard(seed) {
  const r = rng(seed);
  const records = []; // plain objects: the old generation grows
  const byName = new Map(); // looked up by key only (insertion order is ours, but we never rely on it)
  const arrays = []; // typed arrays, off V8's heap (ArrayBuffers)
  let step = 0;
  return function work() {
    let acc = 0x811c9dc5 ^ step;
    const mix = (v) => { acc = Math.imul(acc ^ (v >>> 0), 0x01000193) >>> 0; };
    // new records
    for (let i = 0; i < 1000; i++) {
      const rec = { id: r(), name: "r" + r().toString(16), score: r() / 4294967296, tags: [], parent: null };
      for (let j = r.below(4); j > 0; j--) rec.tags.push(r.below(1000));
      if (records.length) rec.parent = records[r.below(records.length)];
      records.push(rec);
      byName.set(rec.name, rec);
      mix(rec.id);
    }
    // typed arrays: one or two kept per step
    for (let i = 1 + r.below(2); i > 0; i--) {
      const a = new Float64Array(2048 + r.below(16384));
      for (let j = 0; j < a.length; j++) a[j] = r() / 65536;
      arrays.push(a);
    }
    // read back earlier objects and arrays: wrong memory after a restore changes the digest
    for (let i = 0; i < 20000; i++) {
      const rec = records[r.below(records.length)];
      const same = byName.get(rec.name);
      mix(rec.id ^ rec.tags.length ^ (same === rec ? 1 : 0) ^ (rec.parent ? rec.parent.id : 0));
    }
    for (let i = 0; i < 64; i++) {
      const a = arrays[r.below(arrays.length)];
      mix(a[r.below(a.length)] * 65536);
    }
    // garbage: objects, strings and arrays that die within the step
    let garbage = [];
    for (let i = 0; i < 30000; i++) {
      garbage.push({ k: i, v: r(), s: (r() & 0xfff).toString(36) });
      if (garbage.length > 5000) garbage = [];
    }
    const tmp = new Uint32Array(65536);
    for (let i = 0; i < tmp.length; i++) tmp[i] = r();
    mix(tmp[r.below(tmp.length)] ^ garbage.length);
    // now and then, about half of what was kept goes
    if (step % DROP_EVERY === DROP_EVERY - 1) {
      const keep = records.filter(() => r.below(2) === 0);
      for (const rec of records) byName.delete(rec.name);
      records.length = 0;
      for (const rec of keep) {
        rec.parent = null;
        records.push(rec);
        byName.set(rec.name, rec);
      }
      arrays.splice(0, arrays.length >> 1);
    }
    mix(records.length);
    step++;
    return acc;
  };
}

if (!isMainThread) {
  const work = shard(workerData.seed);
  parentPort.on("message", () => parentPort.postMessage(work()));
} else {
  const argv = process.argv.slice(2);
  const opt = { seed: 7, steps: 120, "step-seconds": 0.08, workers: 2 };
  for (let i = 0; i < argv.length; i += 2) {
    const k = argv[i].replace(/^--/, "");
    if (!(k in opt) || i + 1 >= argv.length) throw new Error(`unknown argument ${argv[i]}`);
    opt[k] = Number(argv[i + 1]);
  }
  const line = (s) => process.stdout.write(s + "\n"); // synchronous for files and pipes
  line(`start-up: main thread and ${opt.workers} worker threads, seed ${opt.seed} (pid ${process.pid}, node ${process.version})`);

  const seedOf = (i) => (Math.imul(opt.seed, 1000003) + i) >>> 0;
  const workers = [];
  for (let i = 1; i <= opt.workers; i++) {
    const w = new Worker(__filename, { workerData: { seed: seedOf(i) } });
    const pending = [];
    w.on("message", (v) => pending.shift()(v));
    w.on("error", (e) => { console.error(e); process.exit(1); });
    w.ask = () => new Promise((resolve) => { pending.push(resolve); w.postMessage(0); });
    workers.push(w);
  }
  const mine = shard(seedOf(0));
  const total = crypto.createHash("sha256").update(`heapjs:${opt.seed}`);
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  (async () => {
    for (let step = 0; step < opt.steps; step++) {
      const asked = workers.map((w) => w.ask()); // the workers run while the main thread does its share
      const results = [mine(), ...(await Promise.all(asked))]; // in thread order
      const buf = Buffer.alloc(4 * results.length);
      results.forEach((v, i) => buf.writeUInt32LE(v, 4 * i));
      total.update(buf);
      line(`step ${step + 1}/${opt.steps}`);
      if (opt["step-seconds"] > 0) await sleep(opt["step-seconds"] * 1000);
    }
    line(`done digest=${total.digest("hex").slice(0, 16)}`);
    await Promise.all(workers.map((w) => w.terminate()));
  })();
}
