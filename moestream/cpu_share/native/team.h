// The threads a CPU-share job runs on (expert_kernels.h's compute_job): a function run once on every
// member, with barriers inside it.
//
// The team keeps its own threads: they spin on a job counter for `spin_ns` after their last job (a
// decode step's layers come every few hundred microseconds, and a parked thread takes tens of them
// to wake; an OpenMP region per job measured slower), then sleep until the next job; each member
// can be pinned to its own core, so the engine's threads are left the rest and never preempt one
// (a preempted member holds the whole job at its barrier). The thread that calls run() computes as
// member 0.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_PAUSE() _mm_pause()
#else
#define CPU_PAUSE() ((void)0)
#endif

namespace moestream_native {

using TeamFn = std::function<void(int member, int members)>;

inline int64_t team_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The cores this process may run on, in order.
inline std::vector<int> allowed_cores() {
  std::vector<int> cores;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cores.push_back(c);
  return cores;
}

// Pins the calling thread to `core` (false where it cannot).
inline bool pin_to(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

class Team {
 public:
  // members: the team's size (the caller of run() included); spin_ns: how long a member spins after
  // a job before it sleeps; pin: members 1.. on the last members-1 allowed cores (member 0 is pinned
  // by its own thread where it wants: pin_caller), where the process has members + 1 cores or more.
  Team(int members, int64_t spin_ns, bool pin) : members_(members < 1 ? 1 : members), spin_ns_(spin_ns) {
    const std::vector<int> cores = allowed_cores();
    if (pin && int(cores.size()) > members_) cores_.assign(cores.end() - members_, cores.end());
    for (int m = 1; m < members_; ++m) workers_.emplace_back([this, m] { serve(m); });
  }

  ~Team() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> hold(lock_);
      wake_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

  int size() const { return members_; }
  bool pinned() const { return !cores_.empty(); }

  // Member 0's core for the thread that will call run() (the worker's poller); false where unpinned.
  bool pin_caller() const { return !cores_.empty() && pin_to(cores_[0]); }

  // fn on every member; returns when all are done
  void run(const TeamFn& fn) {
    fn_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);  // publishes fn_ and done_
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> hold(lock_);
      wake_.notify_all();
    }
    fn(0, members_);
    while (done_.load(std::memory_order_acquire) < members_ - 1) CPU_PAUSE();
  }

  // inside fn: every member waits for the others (sense-reversing: the last to arrive flips the sense)
  void barrier() {
    const int sense = sense_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == members_) {
      arrived_.store(0, std::memory_order_relaxed);
      sense_.store(sense ^ 1, std::memory_order_release);
    } else {
      while (sense_.load(std::memory_order_acquire) == sense) CPU_PAUSE();
    }
  }

 private:
  void serve(int member) {
    if (!cores_.empty()) pin_to(cores_[member]);
    int64_t seen = 0;
    while (true) {
      int64_t since = team_now_ns();
      for (int polls = 0; generation_.load(std::memory_order_acquire) == seen; ++polls) {
        if (stop_.load(std::memory_order_relaxed)) return;
        CPU_PAUSE();
        if ((polls & 255) == 255 && team_now_ns() - since > spin_ns_) {  // idle: sleep until a job
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          {
            std::unique_lock<std::mutex> hold(lock_);
            wake_.wait(hold, [&] { return generation_.load(std::memory_order_seq_cst) != seen || stop_.load(); });
          }
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          since = team_now_ns();
        }
      }
      if (stop_.load(std::memory_order_relaxed)) return;
      seen = generation_.load(std::memory_order_acquire);
      (*fn_)(member, members_);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  int members_;
  int64_t spin_ns_;
  std::vector<int> cores_;
  std::vector<std::thread> workers_;
  const TeamFn* fn_ = nullptr;
  std::atomic<int64_t> generation_{0};
  std::atomic<int> done_{0}, arrived_{0}, sense_{0}, sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex lock_;
  std::condition_variable wake_;
};

}  // namespace moestream_native
