// A Go job for the soak: imitates a Go service or batch tool holding its state in memory (an
// in-memory index or cache being built, a log processor, an ETL step written in Go) - goroutines that
// each fill and churn their own maps and slices, so that the heap grows step by step (with garbage
// for Go's concurrent collector to sweep along the way), and a part of it is dropped now and then.
//
//	go build -o /tmp/heap tests/workloads/heap.go
//	/tmp/heap --seed 7 --steps 120 --step-seconds 0.08
//
// Each step starts one goroutine per shard and waits for all of them (sync.WaitGroup); each writes
// its result into its own slot and the slots are folded into the digest in shard order, so the output
// does not depend on scheduling. Maps are only read by key, never ranged over (Go randomizes map
// order). Each shard has its own seeded PRNG (splitmix64) carried from step to step, and each step
// reads back entries kept in earlier steps: the digest depends only on the arguments, and a restored
// run prints the same one as an uninterrupted run only if the heap came back intact. Prints
// "start-up: ..." once, "step N/M" per step, then "done digest=<hex>".
package main

import (
	"crypto/sha256"
	"encoding/binary"
	"flag"
	"fmt"
	"os"
	"runtime"
	"sync"
	"time"
)

const (
	shards    = 4
	dropEvery = 40 // steps: then about half of every shard's map is deleted
)

// rng is splitmix64: the same sequence for the same seed, everywhere.
type rng struct{ s uint64 }

func (r *rng) next() uint64 {
	r.s += 0x9E3779B97F4A7C15
	z := r.s
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

func (r *rng) below(n int) int { return int(r.next() % uint64(n)) }

type record struct {
	id    uint64
	words []uint64
	tags  []string
}

// shard is one goroutine's state, kept from step to step.
type shard struct {
	r      rng
	index  map[uint64]*record // grows every step
	keys   []uint64           // the keys in index, in insertion order (to pick from deterministically)
	blocks [][]byte           // byte slices appended to, some dropped
	step   int
}

func (s *shard) work() uint64 {
	acc := uint64(0xcbf29ce484222325) ^ uint64(s.step)
	mix := func(v uint64) { acc = (acc ^ v) * 0x100000001b3 }
	// new records: the index grows
	for i := 0; i < 700; i++ {
		k := s.r.next()
		rec := &record{id: k, words: make([]uint64, 8+s.r.below(56))}
		for j := range rec.words {
			rec.words[j] = s.r.next()
		}
		for j := s.r.below(3); j > 0; j-- {
			rec.tags = append(rec.tags, fmt.Sprintf("t%x", s.r.next()&0xffff))
		}
		s.index[k] = rec
		s.keys = append(s.keys, k)
		mix(rec.words[0])
	}
	// look-ups of earlier records, by key: wrong memory after a restore changes the digest
	for i := 0; i < 40000 && len(s.keys) > 0; i++ {
		k := s.keys[s.r.below(len(s.keys))]
		if rec, ok := s.index[k]; ok {
			mix(rec.words[s.r.below(len(rec.words))] + uint64(len(rec.tags)))
		} else {
			mix(k)
		}
	}
	// garbage: a temporary map and slices that die within the step
	tmp := make(map[uint64]uint64)
	for i := 0; i < 20000; i++ {
		tmp[uint64(s.r.below(8192))] += s.r.next()
	}
	for i := uint64(0); i < 8192; i += 97 {
		mix(tmp[i])
	}
	scratch := make([]uint64, 0, 16)
	for i := 0; i < 50000; i++ {
		scratch = append(scratch, s.r.next())
	}
	mix(scratch[len(scratch)/2] ^ uint64(len(tmp)))
	// blocks: one appended per step, read back, some dropped
	b := make([]byte, 4096+s.r.below(64<<10))
	for i := range b {
		b[i] = byte(s.r.next())
	}
	s.blocks = append(s.blocks, b)
	for i := 0; i < 8; i++ {
		blk := s.blocks[s.r.below(len(s.blocks))]
		mix(uint64(blk[s.r.below(len(blk))]) | uint64(len(blk))<<8)
	}
	if s.step%dropEvery == dropEvery-1 {
		live := s.keys[:0]
		for _, k := range s.keys {
			if s.r.below(2) == 0 {
				delete(s.index, k)
			} else {
				live = append(live, k)
			}
		}
		s.keys = append([]uint64(nil), live...)
		s.blocks = append([][]byte(nil), s.blocks[len(s.blocks)/2:]...)
	}
	mix(uint64(len(s.index)))
	s.step++
	return acc
}

func main() {
	seed := flag.Uint64("seed", 7, "PRNG seed")
	steps := flag.Int("steps", 120, "steps")
	stepSeconds := flag.Float64("step-seconds", 0.08, "pause after each step")
	flag.Parse()

	fmt.Printf("start-up: %d goroutine shards, seed %d (pid %d, %s)\n", shards, *seed, os.Getpid(), runtime.Version())
	os.Stdout.Sync()

	total := sha256.New()
	fmt.Fprintf(total, "heap:%d", *seed)
	ss := make([]*shard, shards)
	for i := range ss {
		ss[i] = &shard{r: rng{*seed*1000003 + uint64(i)}, index: make(map[uint64]*record)}
	}
	results := make([]uint64, shards)
	var buf [8]byte
	for step := 0; step < *steps; step++ {
		var wg sync.WaitGroup
		for i, s := range ss {
			wg.Add(1)
			go func(i int, s *shard) {
				defer wg.Done()
				results[i] = s.work()
			}(i, s)
		}
		wg.Wait()
		for _, v := range results { // in shard order
			binary.LittleEndian.PutUint64(buf[:], v)
			total.Write(buf[:])
		}
		fmt.Printf("step %d/%d\n", step+1, *steps) // os.Stdout is unbuffered: one write per line
		if *stepSeconds > 0 {
			time.Sleep(time.Duration(*stepSeconds * float64(time.Second)))
		}
	}
	fmt.Printf("done digest=%x\n", total.Sum(nil)[:8])
}
