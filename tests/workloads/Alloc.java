/*
 * A JVM job for the soak: imitates a multi-threaded Java service or batch job (a Spark executor, a
 * Kafka Streams app, a Flink task manager) - a pool of threads allocating arrays, linked objects and
 * hash maps, keeping some and dropping the rest, so that the garbage collector runs all the time and
 * the heap grows for a while, then shrinks (a large part is dropped and System.gc() hands memory back).
 *
 *     java -XX:-UsePerfData -Xmx256m tests/workloads/Alloc.java --seed 7 --steps 120 --step-seconds 0.08
 *
 * (-XX:-UsePerfData: no hsperfdata file mmap'd from /tmp, which another node would not have.)
 *
 * Each step hands every thread its share of the work and waits for all of them (invokeAll); their
 * results are folded into the digest in thread order, so the output does not depend on scheduling.
 * Each thread has its own seeded PRNG (splitmix64) carried from step to step, and each step also reads
 * back arrays it kept earlier: the digest depends only on the arguments, and a restored run prints
 * the same one as an uninterrupted run only if the retained heap came back intact. Prints
 * "start-up: ..." once, "step N/M" per step, then "done digest=<hex>".
 */

import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.concurrent.Callable;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;

public class Alloc {
    static final int THREADS = 4;
    static final int SHRINK_EVERY = 30; // steps: the retained heap grows for this many, then most of it is dropped

    /** splitmix64: the same sequence for the same seed, on every JVM. */
    static final class Rng {
        long s;

        Rng(long seed) { s = seed; }

        long next() {
            long z = (s += 0x9E3779B97F4A7C15L);
            z = (z ^ (z >>> 30)) * 0xBF58476D1CE4E5B9L;
            z = (z ^ (z >>> 27)) * 0x94D049BB133111EBL;
            return z ^ (z >>> 31);
        }

        int below(int n) { return (int) Long.remainderUnsigned(next(), n); }
    }

    static final class Node {
        final long value;
        final Node next;
        final byte[] pad;

        Node(long value, Node next, int padBytes) {
            this.value = value;
            this.next = next;
            this.pad = new byte[padBytes];
        }
    }

    /** One thread's share: its PRNG and what it keeps from step to step. */
    static final class Worker implements Callable<Long> {
        final int id;
        final Rng rng;
        final List<long[]> kept = new ArrayList<>();
        final HashMap<Long, int[]> table = new HashMap<>();
        int step;

        Worker(long seed, int id) {
            this.id = id;
            this.rng = new Rng(seed * 1000003L + id);
        }

        @Override
        public Long call() {
            long acc = 0x243F6A8885A308D3L ^ ((long) id << 32) ^ step;
            // arrays: most are garbage at once, some are kept (the heap grows)
            for (int i = 0; i < 120; i++) {
                long[] a = new long[1024 + rng.below(16 * 1024)];
                long x = rng.next();
                for (int j = 0; j < a.length; j++) {
                    x ^= x << 13; x ^= x >>> 7; x ^= x << 17;
                    a[j] = x;
                }
                acc = acc * 31 + a[rng.below(a.length)];
                if (rng.below(12) == 0) {
                    kept.add(a);
                }
            }
            // linked objects: a list built, walked, then dropped
            Node head = null;
            int n = 30000 + rng.below(30000);
            for (int i = 0; i < n; i++) {
                head = new Node(rng.next(), head, rng.below(64));
            }
            for (Node p = head; p != null; p = p.next) {
                acc += p.value ^ p.pad.length;
            }
            // a map that churns: entries put and removed by key (never iterated: its order is not ours)
            for (int i = 0; i < 20000; i++) {
                long key = rng.below(4096);
                int[] v = table.get(key);
                if (v == null) {
                    v = new int[16 + rng.below(240)];
                    v[0] = (int) rng.next();
                    table.put(key, v);
                } else if (rng.below(3) == 0) {
                    table.remove(key);
                } else {
                    v[0] = v[0] * 1103515245 + 12345;
                }
                acc = acc * 1099511628211L + (v[0] ^ v.length);
            }
            acc += table.size();
            // read back what was kept in earlier steps: wrong memory after a restore changes the digest
            for (int i = 0; i < 16 && !kept.isEmpty(); i++) {
                long[] a = kept.get(rng.below(kept.size()));
                for (int j = 0; j < a.length; j += 61) {
                    acc = Long.rotateLeft(acc, 5) ^ a[j];
                }
            }
            // and every SHRINK_EVERY steps most of it goes (the heap shrinks)
            if (step % SHRINK_EVERY == SHRINK_EVERY - 1) {
                List<long[]> keep = new ArrayList<>();
                for (long[] a : kept) {
                    if (rng.below(10) == 0) {
                        keep.add(a);
                    }
                }
                kept.clear();
                kept.addAll(keep);
            }
            step++;
            return acc;
        }
    }

    public static void main(String[] args) throws Exception {
        long seed = 7;
        int steps = 120;
        double stepSeconds = 0.08;
        for (int i = 0; i < args.length; i++) {
            switch (args[i]) {
                case "--seed": seed = Long.parseLong(args[++i]); break;
                case "--steps": steps = Integer.parseInt(args[++i]); break;
                case "--step-seconds": stepSeconds = Double.parseDouble(args[++i]); break;
                default: throw new IllegalArgumentException("unknown argument " + args[i]);
            }
        }
        System.out.println("start-up: " + THREADS + " allocating threads, seed " + seed + " (pid "
                + ProcessHandle.current().pid() + ", java " + System.getProperty("java.version") + ")");
        System.out.flush();

        MessageDigest total = MessageDigest.getInstance("SHA-256");
        total.update(("alloc:" + seed).getBytes(StandardCharsets.UTF_8));
        List<Worker> workers = new ArrayList<>();
        for (int t = 0; t < THREADS; t++) {
            workers.add(new Worker(seed, t));
        }
        ExecutorService pool = Executors.newFixedThreadPool(THREADS);
        byte[] buf = new byte[8];
        for (int step = 0; step < steps; step++) {
            List<Future<Long>> results = pool.invokeAll(workers); // every thread's step, all joined
            for (Future<Long> f : results) { // in thread order
                long v = f.get();
                for (int k = 0; k < 8; k++) {
                    buf[k] = (byte) (v >>> (8 * k));
                }
                total.update(buf);
            }
            System.out.println("step " + (step + 1) + "/" + steps);
            System.out.flush();
            if (step % SHRINK_EVERY == SHRINK_EVERY - 1) {
                System.gc(); // hand the dropped part back (the committed heap shrinks)
            }
            if (stepSeconds > 0) {
                Thread.sleep((long) (stepSeconds * 1000));
            }
        }
        pool.shutdown();
        StringBuilder hex = new StringBuilder();
        for (byte b : total.digest()) {
            hex.append(String.format("%02x", b));
        }
        System.out.println("done digest=" + hex.substring(0, 16));
        System.out.flush();
    }
}
